"""A fleet on one machine: 16 hosts' agents, one Prometheus, one Alertmanager, real parts only.

- 16 real agent daemons (``python -m precision_agent run``) on 127.0.0.1, one per simulated host,
  each tailing the logs of 4 ranks of each of two training runs (``gptA``, ``gptB``: 64 ranks
  each) that a separate job process (tests/support/fleet_job.py) appends in lock-step, as a
  data-parallel job logs;
- a real Prometheus (Debian 2.42) finding the agents through ``file_sd_configs`` (a target file
  listing the 16 hosts) and evaluating the shipped rules, exporters/prometheus/alerts.yml;
- a real Alertmanager (Debian 0.25) running the shipped exporters/alertmanager/alertmanager.yml
  and posting to a webhook sink in this process.

One rank of run gptA goes NaN first, every other rank two steps later (the all-reduce); so does run
gptB on other ranks of the same hosts. Each run gets exactly one notification, naming its origin
host (``instance``, and the target's ``host`` label) and rank, and the propagated copies of every
rank are inhibited. gptA's origin rank also dumped its step (msprobe, to a dump watch labelled
with the run): the page names its first bad op. gptA then restarts from a checkpoint: the incident resolves and a resolved
notification follows, with no page for the copies in between.

What the test changes in copies of the shipped files, and why (everything else as shipped):
- Prometheus scrapes and evaluates every second (the test's own prometheus.yml);
- Alertmanager: receivers point at the sink (same paths), and the group timers are seconds:
  ``group_wait`` 5s (shipped 30s: it stays above a scrape plus an evaluation interval, which is
  what lets the origin join its run's group before the first notification) and
  ``group_interval`` 2s (shipped 5m: when the resolved notification can go out). Routes,
  ``group_by`` and inhibition rules are untouched;
- the incident's durations, scaled from minutes to seconds with their order kept: the copies'
  ``resolve_after`` in copies of the agent rule files, ``TrainingNonFinite`` 10m -> 3s and
  ``DumpNonFinite`` 1h -> 6s, and the window for which alerts.yml remembers the origin,
  ``[70m]`` -> ``[12s]``. The origin must outlive the copies after a restart, or its end would
  lift their inhibition. And the agents' ``dump_settle`` (a config setting, 5s by default) is 0.5s.

Machine cost: 18 processes on 2 cores; the agents read 128 log files and one dump and answer 16 scrapes a
second. Every wait is a poll with a deadline; a failure prints every process's log tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from support.prom import (REPO, Proc, free_port, find_binary, get_json, is_ready, prom_query,
                         running_alertmanager, stop_all, wait_alive, wait_until)
from support.prom import WebhookSink
from support.promstack import fleet_job, finish, shipped_alertmanager_config, shipped_prom_rules, start_prometheus

pytestmark = pytest.mark.e2e

HOSTS, PER_HOST = 16, 4
RANKS = HOSTS * PER_HOST
JOB = "precision-agent"
RUN_A, RUN_B = "gptA", "gptB"
ORIGIN = {RUN_A: 22, RUN_B: 45}     # global ranks: host 5 rank 22, host 11 rank 45
BAD_OP = "Functional.linear.3.forward"
JOB_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "fleet_job.py"   # also its dump form
RESOLVE_AFTER = {"TrainingNonFinite": ("10m", "3s"), "DumpNonFinite": ("1h", "6s")}   # shipped, here
ORIGIN_WINDOW = ("[70m]", "[12s]")  # alerts.yml's memory of the origin (and its verdict): shipped, here


def _agent_rules(dest: Path) -> Path:
    """Copies of the shipped agent rule files; only the copies' resolve_after changes."""
    dest.mkdir()
    changed = 0
    for f in sorted((REPO / "rules").glob("*.yml")):
        doc = yaml.safe_load(f.read_text())
        for g in doc["groups"]:
            for r in g["rules"]:
                if r.get("alert") in RESOLVE_AFTER:
                    shipped, here = RESOLVE_AFTER[r["alert"]]
                    assert r["resolve_after"] == shipped, r
                    r["resolve_after"] = here
                    changed += 1
        (dest / f.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    assert changed == len(RESOLVE_AFTER)
    return dest


def _job(root: Path, run: str, first: int, last: int, pause: float = 0.0,
         nan_from: dict[int, int] | None = None) -> subprocess.Popen:
    return fleet_job(root, run, HOSTS, PER_HOST, first, last, pause, nan_from)


@dataclass
class Fleet:
    root: Path
    sink: WebhookSink
    am_url: str = ""
    prom_url: str = ""
    targets: dict[int, str] = field(default_factory=dict)     # host -> 127.0.0.1:port
    procs: list[Proc] = field(default_factory=list)
    jobs: list[subprocess.Popen] = field(default_factory=list)   # job processes still running
    agents: dict[int, Proc] = field(default_factory=dict)
    restarts: int = 0

    @property
    def sd_file(self) -> Path:
        return self.root / "targets.json"

    def logs(self) -> str:
        parts = [p.tail(2500) for p in self.procs if not p.alive() or p.name == "prometheus"]
        parts.append(f"----- webhook: {json.dumps(self.sink.received)[-5000:]}")
        return "\n".join(parts)

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        return wait_alive(self.procs, predicate, timeout, what, on_timeout=self.logs)

    def notifications(self, run: str, status: str | None = None) -> list[dict[str, Any]]:
        """Every webhook payload of ``run``'s groups, on any receiver."""
        return [p for p in self.sink.payloads() if p["groupLabels"].get("run") == run
                and (status is None or p["status"] == status)]

    def am_alerts(self, **labels: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode([("filter", f'{k}="{v}"') for k, v in labels.items()])
        return get_json(f"{self.am_url}/api/v2/alerts?{q}")


def _start_agent(fleet: Fleet, h: int) -> None:
    """Host h's agent on a free loopback port, listed in the file_sd target file."""
    home = fleet.root / f"h{h:02d}"
    port = free_port()
    proc = Proc(f"agent-h{h:02d}", [sys.executable, "-m", "precision_agent", "run", "--config", str(home / "agent.yml"),
                                    "--state", str(home / "state"), "--listen", f"127.0.0.1:{port}"],
                fleet.root, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    fleet.procs.insert(0, proc)
    fleet.agents[h] = proc
    fleet.targets[h] = f"127.0.0.1:{port}"
    fleet.sd_file.write_text(json.dumps([{"targets": [t], "labels": {"host": f"h{n:02d}"}}
                                         for n, t in sorted(fleet.targets.items())]))


def _start_agents(fleet: Fleet, rules: Path) -> None:
    for h in range(HOSTS):
        home = fleet.root / f"h{h:02d}"
        (home / "dumps").mkdir()
        (home / "agent.yml").write_text(yaml.safe_dump({
            "watches": [{"path": str(home / "logs")},
                        {"path": str(home / "dumps"), "kind": "dump", "labels": {"run": RUN_A}}],
            "default_rules": False, "rule_dirs": [str(rules)], "dump_settle": "0.5s",
            "limits": {"nice": 0, "io_idle": False}}))
        _start_agent(fleet, h)


def _agents_ready(fleet: Fleet) -> bool:
    """All agents answer /-/ready; one that lost its port to another process (the free port was
    taken between probe and bind) starts again on another."""
    for h, proc in list(fleet.agents.items()):
        if not proc.alive():
            proc.stop()
            if "Address already in use" not in proc.log_path.read_text(errors="replace") or fleet.restarts >= 5:
                proc.check_alive()
            fleet.restarts += 1
            fleet.procs.remove(proc)
            proc.log_path.rename(proc.log_path.with_suffix(f".{fleet.restarts}.log"))
            _start_agent(fleet, h)
    return all(is_ready(f"http://{t}/-/ready") for t in fleet.targets.values())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    find_binary("prometheus")   # skipped (failed under CI) before anything starts when it is missing
    root = tmp_path_factory.mktemp("fleet")
    sink = WebhookSink()
    f = Fleet(root, sink)
    with ExitStack() as stack:
        stack.callback(sink.close)
        stack.callback(lambda: stop_all(f.procs))
        stack.callback(lambda: [(p.terminate(), p.communicate(timeout=30)) for p in f.jobs if p.poll() is None])
        # the job has been running for a while: four healthy steps of both runs on every rank
        for p in [_job(root, RUN_A, 1, 4), _job(root, RUN_B, 1, 4)]:
            finish(p)
        _start_agents(f, _agent_rules(root / "agent-rules"))
        (root / "am").mkdir()
        f.am_url = stack.enter_context(running_alertmanager(
            shipped_alertmanager_config(sink.port, group_wait="5s", group_interval="2s"), root / "am"))
        prom, f.prom_url = start_prometheus(
            root, shipped_prom_rules(root / "alerts.yml", ORIGIN_WINDOW, 5), f.am_url,
            [{"job_name": JOB, "file_sd_configs": [{"files": [str(f.sd_file)]}]}])
        f.procs.append(prom)
        wait_until(lambda: _agents_ready(f), 60, f"{HOSTS} agents ready", on_timeout=f.logs)
        yield f


def _alerts(payload: dict[str, Any], status: str) -> list[tuple[str, str, str, str]]:
    return [(a["labels"]["alertname"], a["labels"]["instance"], a["labels"].get("host", ""), a["labels"]["rank"])
            for a in payload["alerts"] if a["status"] == status]


def test_one_page_per_incident_naming_the_origin_then_resolved(fleet: Fleet) -> None:
    f = fleet
    t0 = time.monotonic()
    series = f"count(precision_agent_training_step{{job=\"{JOB}\"}})"
    f.wait(lambda: [float(r["value"][1]) for r in prom_query(f.prom_url, series)] == [2.0 * RANKS], 60,
           f"Prometheus scraping {2 * RANKS} training series from {HOSTS} file_sd targets")
    assert [float(r["value"][1]) for r in prom_query(f.prom_url, f'count(up{{job="{JOB}"}} == 1)')] == [HOSTS]
    assert not f.sink.received

    # both runs: one rank goes NaN at one step, every other rank two steps later; the jobs go on
    # logging NaN steps (each is a new hit of the agents' TrainingNonFinite) until stopped
    t_nan = time.monotonic()
    origin_host = f.root / f"h{ORIGIN[RUN_A] // PER_HOST:02d}"
    subprocess.run([sys.executable, str(JOB_SCRIPT), "dump", str(origin_host / "dumps"), "6", str(ORIGIN[RUN_A]),
                    BAD_OP], check=True, timeout=60)   # gptA's origin rank dumped its step 6
    jobs = {run: _job(f.root, run, 5, 500, 0.6, {r: (6 if r == ORIGIN[run] else 8) for r in range(RANKS)})
            for run in (RUN_A, RUN_B)}
    f.jobs.extend(jobs.values())

    def origin_of(run: str) -> tuple[str, str, str, str]:
        h = ORIGIN[run] // PER_HOST
        return ("TrainingNonFiniteOrigin", f.targets[h], f"h{h:02d}", str(ORIGIN[run]))

    pages = f.wait(lambda: all(f.notifications(run, "firing") for run in (RUN_A, RUN_B))
                   and {run: f.notifications(run, "firing") for run in (RUN_A, RUN_B)}, 60,
                   "a page for each run")
    t_paged = time.monotonic()
    for run in (RUN_A, RUN_B):
        (page,) = pages[run]
        assert _alerts(page, "firing") == [origin_of(run)], page
        # A rank whose copy was scraped before the origin's NaN can be the origin as far as
        # Prometheus knows for an evaluation or two: it is sent, then resolved, within group_wait,
        # and rides along as "resolved" (send_resolved). Only origins, only of this run.
        assert {a[0] for a in _alerts(page, "resolved")} <= {"TrainingNonFiniteOrigin"}, page
        assert page["receiver"] == "page" and page["groupLabels"] == {"job": JOB, "run": run}, page
        (alert,) = [a for a in page["alerts"] if a["status"] == "firing"]
        assert alert["labels"]["origin"] == "true" and alert["labels"]["severity"] == "page", alert
        op = f", first bad op {BAD_OP}" if run == RUN_A else ""    # gptB has no dumps
        assert alert["annotations"]["summary"] == (
            f"NaN/Inf started on {f.targets[ORIGIN[run] // PER_HOST]} rank {ORIGIN[run]} at step 6{op} (run {run})")

    # every rank's own TrainingNonFinite reached Alertmanager and is inhibited by the origin
    def copies(run: str) -> dict[str, set[str]]:
        """state -> ranks of the run's copies in Alertmanager"""
        out: dict[str, set[str]] = {}
        for a in f.am_alerts(alertname="PrecisionAgentAlertFiring", agent_alertname="TrainingNonFinite", run=run):
            state = a["status"]["state"] if a["status"]["inhibitedBy"] or a["status"]["state"] != "suppressed" \
                else "silenced"
            out.setdefault(state, set()).add(a["labels"]["rank"])
        return out

    every = {"suppressed": {str(r) for r in range(RANKS)}}
    try:
        f.wait(lambda: all(copies(run) == every for run in (RUN_A, RUN_B)), 30,
               f"all {RANKS} ranks' TrainingNonFinite copies of both runs inhibited in Alertmanager")
    except AssertionError as exc:
        raise AssertionError(f"copies by state: {[copies(run) for run in (RUN_A, RUN_B)]}\n{exc}") from None

    # gptA restarts from its checkpoint at step 3: the incident resolves
    t_restart = time.monotonic()
    jobs[RUN_A].terminate()
    finish(jobs[RUN_A])
    finish(_job(f.root, RUN_A, 3, 5, 0.5))
    resolved = f.wait(lambda: f.notifications(RUN_A, "resolved"), 60, "the resolved notification of gptA")
    t_resolved = time.monotonic()
    (done,) = resolved
    assert not _alerts(done, "firing") and origin_of(RUN_A) in _alerts(done, "resolved"), done
    assert {a[0] for a in _alerts(done, "resolved")} == {"TrainingNonFiniteOrigin"}, done
    # by then every copy has resolved too, while still inhibited: nothing else was ever sent for
    # either run, and gptB's incident is still on
    assert len(f.notifications(RUN_A, "firing")) == 1 and len(f.notifications(RUN_B, "firing")) == 1, \
        json.dumps([(p["receiver"], p["status"], [(a["status"], a["labels"]) for a in p["alerts"]])
                    for p in f.notifications(RUN_A) + f.notifications(RUN_B)], indent=1)
    assert not f.am_alerts(alertname="PrecisionAgentAlertFiring", agent_alertname="TrainingNonFinite", run=RUN_A)
    assert {a["labels"]["alertname"] for a in f.am_alerts(run=RUN_B, severity="page")
            if a["status"]["state"] == "active"} == {"TrainingNonFiniteOrigin"}
    print(f"\nfleet: {HOSTS} agents, {2 * RANKS} series scraped {t_nan - t0:.1f}s after the test began; "
          f"NaN -> one page per run {t_paged - t_nan:.1f}s; restart -> resolved {t_resolved - t_restart:.1f}s")
