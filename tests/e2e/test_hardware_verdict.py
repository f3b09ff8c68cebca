"""Hardware or numerics, end to end: who gets paged for a NaN depends on the origin host's hardware.

Real parts only, as tests/e2e/test_fleet.py:
- two hosts' agents (``python -m precision_agent run``, 127.0.0.1), each following the Megatron-LM
  logs of two ranks of each of two data-parallel runs, appended in lock-step by a separate job
  process (tests/support/fleet_job.py): ranks 0-1 on host hA, 2-3 on hB;
- a DCGM-exporter-shaped target per host: a static text exposition served by this process
  (tests/support/promstack.py) with dcgm-exporter's metric names and labels (NVIDIA/dcgm-exporter,
  etc/default-counters.csv), which the test changes between scrapes;
- a real Prometheus (Debian 2.42) finding the agents and the exporters through ``file_sd_configs``,
  each target labelled with its ``host`` (all listen on 127.0.0.1, so the address alone cannot
  tell the hosts apart: the documented `host` target label does), evaluating the shipped rules;
- a real Alertmanager (Debian 0.25) running the shipped configuration, posting to a webhook sink.

Run gptA's first NaN is on hA rank 0, whose GPU 0 has just reported Xid 79 (fallen off the bus):
the origin's verdict is suspect="hardware" and the page goes to the ``infra`` receiver, with the
host-level SuspectHardware; the job owner's ``page`` receiver gets nothing of gptA. Run gptB's
first NaN is on hB rank 3, whose GPU only reported an application Xid (13, the program's fault) and
power throttling, and whose log has Megatron's rerun verdict (the NaN was reproducible on the same
GPU, then on another one, so the model's): the page goes to the owner with suspect="numerics", never
to infra.

What the test changes, as test_fleet.py does: Prometheus scrapes and evaluates every second, and
Alertmanager's group timers are seconds (group_wait 5s, group_interval 2s). Rules, routes and
inhibitions are as shipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from support.prom import (Proc, find_binary, is_ready, prom_query, running_alertmanager, start_listening,
                          stop_all, wait_alive)
from support.prom import WebhookSink
from support.promstack import (Exposition, finish, fleet_job, shipped_alertmanager_config, shipped_prom_rules,
                               start_prometheus)

pytestmark = pytest.mark.e2e

HOSTS, PER_HOST = ("hA", "hB"), 2          # fleet_job's h00 is hA (ranks 0, 1), h01 is hB (2, 3)
JOB = "precision-agent"
RUN_HW, RUN_NUM = "gptA", "gptB"
ORIGIN = {RUN_HW: 0, RUN_NUM: 3}           # global ranks


def dcgm_exposition(host: str, xid: dict[int, int], power_violation_us: int = 0) -> str:
    """What dcgm-exporter serves for a host's two GPUs (its default counters; field names and
    labels as the exporter writes them)."""
    out = []

    def family(name: str, kind: str, help_: str, values: dict[int, int]) -> None:
        out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        for gpu, v in values.items():
            out.append(f'{name}{{gpu="{gpu}",UUID="GPU-{host}-000{gpu}",device="nvidia{gpu}",'
                       f'modelName="NVIDIA H100 80GB HBM3",Hostname="{host}",DCGM_FI_DRIVER_VERSION="550.54.15"}} {v}')

    family("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", xid)
    family("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
           "Number of remapped rows for uncorrectable errors", {g: 0 for g in xid})
    family("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed", {g: 0 for g in xid})
    family("DCGM_FI_DEV_POWER_VIOLATION", "counter", "Throttling duration due to power constraints (in us).",
           {g: power_violation_us for g in xid})
    return "\n".join(out) + "\n"


# Megatron-LM's rerun state machine (megatron/core/rerun_state_machine.py, validate_result and
# log_failure) on the rank whose loss was NaN: the first rerun on the same GPU gave the same
# result, and so did the second one, from the checkpoint on another GPU: the result is correct
# for its inputs, "possible Application error" (a numerical problem of the model, not the GPU).
def rerun_lines(rank: int, node: str, iteration: int) -> str:
    msg = "found NaN in local forward loss calculation"
    return (f"Unexpected result nan on rank {rank} at iteration #{iteration} invocation #1 (message='{msg}')\n"
            f"Rank {rank}, node {node}, device 1, iteration #{iteration}: First rerun: unexpected result is "
            f"reproducible within the tolerance (nan = nan). Need to rerun on a different GPU to verify "
            f"correctness.!\n"
            f"Second rerun: unexpected result is reproducible on a different GPU, therefore it was likely "
            f"correct (nan = nan)\n"
            f"Rank {rank}, node {node}-spare, device 0, iteration #{iteration}: Correct result (but possible "
            f"Application error) ({msg})!\n")


@dataclass
class Stack:
    root: Path
    sink: WebhookSink
    prom_url: str = ""
    procs: list[Proc] = field(default_factory=list)
    agents: dict[str, str] = field(default_factory=dict)        # host -> 127.0.0.1:port
    exporters: dict[str, Exposition] = field(default_factory=dict)

    def logs(self) -> str:
        parts = [p.tail(2500) for p in self.procs]
        parts.append(f"----- webhook: {json.dumps(self.sink.received)[-5000:]}")
        return "\n".join(parts)

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        return wait_alive(self.procs, predicate, timeout, what, on_timeout=self.logs)

    def query(self, expr: str) -> list[dict[str, Any]]:
        return prom_query(self.prom_url, expr)

    def firing(self, receiver: str, run: str | None = None) -> list[dict[str, Any]]:
        """Firing alerts notified to ``receiver`` (of ``run``'s groups, if given)."""
        return [a for p in self.sink.payloads(f"/precision-agent/{receiver}") for a in p["alerts"]
                if a["status"] == "firing" and (run is None or p["groupLabels"].get("run") == run)]


def _job(root: Path, run: str, first: int, last: int, pause: float = 0.0,
         nan_from: dict[int, int] | None = None) -> subprocess.Popen:
    return fleet_job(root, run, len(HOSTS), PER_HOST, first, last, pause, nan_from)


def _sd(path: Path, targets: dict[str, str]) -> None:
    path.write_text(json.dumps([{"targets": [t], "labels": {"host": h}} for h, t in sorted(targets.items())]))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    find_binary("prometheus")   # skipped (failed under CI) before anything starts when it is missing
    root = tmp_path_factory.mktemp("hw")
    sink = WebhookSink()
    s = Stack(root, sink)
    with ExitStack() as es:
        es.callback(sink.close)
        es.callback(lambda: stop_all(s.procs))
        for run in (RUN_HW, RUN_NUM):                 # the runs have been going for a while
            finish(_job(root, run, 1, 4))
        for i, host in enumerate(HOSTS):
            home = root / f"h{i:02d}"
            (home / "agent.yml").write_text(yaml.safe_dump({
                "watches": [{"path": str(home / "logs")}], "limits": {"nice": 0, "io_idle": False}}))
            proc, port = start_listening(f"agent-{host}", lambda p, home=home: [
                sys.executable, "-m", "precision_agent", "run", "--config", str(home / "agent.yml"),
                "--state", str(home / "state"), "--listen", f"127.0.0.1:{p}"], root,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
            s.procs.append(proc)
            s.agents[host] = f"127.0.0.1:{port}"
            s.exporters[host] = Exposition(dcgm_exposition(host, {0: 0, 1: 0}))
            es.callback(s.exporters[host].close)
        _sd(root / "agents.json", s.agents)
        _sd(root / "dcgm.json", {h: f"127.0.0.1:{e.port}" for h, e in s.exporters.items()})
        (root / "am").mkdir()
        am_url = es.enter_context(running_alertmanager(
            shipped_alertmanager_config(sink.port, group_wait="5s", group_interval="2s"), root / "am"))
        prom, s.prom_url = start_prometheus(root, shipped_prom_rules(root / "alerts.yml"), am_url, [
            {"job_name": JOB, "file_sd_configs": [{"files": [str(root / "agents.json")]}]},
            {"job_name": "dcgm-exporter", "file_sd_configs": [{"files": [str(root / "dcgm.json")]}]}])
        s.procs.append(prom)
        s.wait(lambda: all(is_ready(f"http://{t}/-/ready") for t in s.agents.values()), 60, "both agents ready")
        yield s


def test_hardware_origin_pages_infra_and_numerics_origin_pages_the_owner(stack: Stack) -> None:
    s = stack
    # every target scraped, the training series of both runs in, and the Xid gauges seen at 0
    # for a few scrapes (so that a change is a change)
    s.wait(lambda: [float(r["value"][1]) for r in s.query("count(up == 1)")] == [4.0]
           and [float(r["value"][1]) for r in s.query(f'count(precision_agent_training_step{{job="{JOB}"}})')]
           == [2.0 * len(HOSTS) * PER_HOST]
           and [float(r["value"][1]) for r in s.query("min(count_over_time(DCGM_FI_DEV_XID_ERRORS[1m]))")][0] >= 3,
           60, "Prometheus scraping 2 agents and 2 DCGM targets")
    assert {r["metric"]["instance"]: r["metric"]["host"] for r in s.query("precision_agent:target_host:info")} == {
        **{t: h for h, t in s.agents.items()}, **{f"127.0.0.1:{e.port}": h for h, e in s.exporters.items()}}

    # hA's GPU 0 falls off the bus; hB's GPU 1 reports an application Xid and throttles: only hA
    # has hardware evidence
    s.exporters["hA"].set(dcgm_exposition("hA", {0: 79, 1: 0}))
    s.exporters["hB"].set(dcgm_exposition("hB", {0: 0, 1: 13}, power_violation_us=4_000_000))
    evidence = s.wait(lambda: s.query("host:precision_agent_hardware_evidence:10m"), 30,
                      "hA's Xid 79 as hardware evidence")
    s.wait(lambda: s.query('DCGM_FI_DEV_XID_ERRORS{host="hB"} == 13'), 30, "hB's Xid 13 scraped")
    evidence = s.query("host:precision_agent_hardware_evidence:10m")
    assert [(r["metric"]["host"], r["metric"]["source"], r["metric"]["device"], r["value"][1]) for r in evidence] \
        == [("hA", "dcgm_xid", "nvidia0", "79")], evidence

    # both runs go NaN: gptA first on hA rank 0, gptB first on hB rank 3 (whose log also has the
    # rerun verdict), every other rank two steps later (the all-reduce)
    with open(s.root / "h01" / "logs" / f"{RUN_NUM}_rank{ORIGIN[RUN_NUM]}.log", "a", encoding="utf-8") as f:
        f.write(rerun_lines(ORIGIN[RUN_NUM], "hB", 6))
    ranks = range(len(HOSTS) * PER_HOST)
    jobs = [_job(s.root, run, 5, 40, 0.5, {r: 6 if r == ORIGIN[run] else 8 for r in ranks}) for run in ORIGIN]
    try:
        s.wait(lambda: s.firing("infra", RUN_HW) and s.firing("page", RUN_NUM)
               and s.firing("infra") and [p for p in s.sink.payloads("/precision-agent/infra")
                                          if p["groupLabels"] == {"host": "hA"}],
               90, "gptA's page to infra, hA's SuspectHardware, and gptB's page to the owner")
    finally:
        for p in jobs:
            p.terminate()
            finish(p)

    (hw,) = {json.dumps(a["labels"], sort_keys=True): a for a in s.firing("infra", RUN_HW)}.values()
    assert hw["labels"]["alertname"] == "TrainingNonFiniteOrigin" and hw["labels"]["suspect"] == "hardware", hw
    assert (hw["labels"]["instance"], hw["labels"]["host"], hw["labels"]["rank"]) == (s.agents["hA"], "hA", "0"), hw
    assert "Suspect hardware" in hw["annotations"]["description"], hw
    (host,) = {a["labels"]["alertname"]: a for p in s.sink.payloads("/precision-agent/infra")
               if p["groupLabels"] == {"host": "hA"} for a in p["alerts"] if a["status"] == "firing"}.values()
    assert host["labels"]["alertname"] == "SuspectHardware" and host["labels"]["host"] == "hA", host

    owner = s.firing("page", RUN_NUM)
    assert {a["labels"]["alertname"] for a in owner} == {"TrainingNonFiniteOrigin"}, owner
    # the owner's page names hB rank 3, "numerics" by Megatron's rerun verdict (reproducible on
    # another GPU): never hardware, whatever hB's application Xid and throttling
    assert {(a["labels"]["host"], a["labels"]["rank"]) for a in owner} == {("hB", "3")}, owner
    assert {a["labels"]["suspect"] for a in owner} == {"numerics"}, owner
    # nothing of gptA reached the owner, nothing of gptB or hB reached infra: the copies of both
    # runs were inhibited by their origins, whichever receiver the origin went to
    assert not s.firing("page", RUN_HW), s.sink.payloads("/precision-agent/page")
    assert not s.firing("infra", RUN_NUM), s.sink.payloads("/precision-agent/infra")
    assert not [a for a in s.firing("infra") if a["labels"].get("host") == "hB"], s.sink.payloads("/precision-agent/infra")
    assert {a["labels"]["alertname"] for a in s.firing("infra")} == {"TrainingNonFiniteOrigin", "SuspectHardware"}
