"""End to end with the real monitoring stack: agent -> Prometheus -> Alertmanager -> webhook.

Real processes only, all on 127.0.0.1 with free ports and temporary storage:

- the precision-agent (``python -m precision_agent run``) watching a temporary log directory;
- Prometheus 2.42 (Debian) scraping it every second and evaluating
  ``exporters/prometheus/alerts.yml`` every second;
- Alertmanager 0.25 (Debian, gossip off) routing ``severity=page`` and ``severity=ticket`` to two
  paths of a webhook sink that runs in a thread of this test;
- a separate "training job" process appending Megatron-LM lines to a log in the watched dir.

Prometheus applies its scrape and notifier targets on a fixed 5 s tick, so the first scrape
comes ~5-7 s after start: the stack is started once per module. Every wait is a poll with a
deadline; on failure the message carries the tails of all process logs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from support.prom import (PROM_DIR, Proc, WebhookSink, alertmanager_wrapper, find_binary, get_json, http_get,
                          in_ci, prom_query, start_listening, stop_all, wait_until)

pytestmark = pytest.mark.e2e

SUPPORT = Path(__file__).resolve().parents[1] / "support" / "prom.py"
ALERTS = PROM_DIR / "alerts.yml"
JOB = "precision-agent"        # the scrape job name alerts.yml expects
RUN = "e2e-run"                # a watch label, to see series labels travel to Alertmanager
COLLAPSE = [65536.0 / 2 ** k for k in range(1, 17)]   # 32768 ... 1.0: one halving per line

# The metric families /metrics must have samples for once a log produced training series and an
# alert fired (what an operator's dashboards and alerts.yml rely on).
POPULATED = ["precision_agent_build_info", "precision_agent_errors", "precision_agent_log_lines_read",
             "precision_agent_training_loss", "precision_agent_training_loss_scale",
             "precision_agent_training_grad_norm", "precision_agent_training_step",
             "precision_agent_training_last_update_timestamp_seconds",
             "precision_agent_training_overflow_steps", "precision_agent_training_loss_scale_decreases",
             "precision_agent_training_nonfinite_values", "precision_agent_alerts",
             "precision_agent_findings"]


def _agent_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _agent_argv(port: int, state: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "precision_agent", "run", "--listen", f"127.0.0.1:{port}",
            "--state", str(state), "--log-level", "info", *extra]


def _agent_alerts(base: str) -> dict[str, dict[str, Any]]:
    doc = get_json(f"{base}/api/v1/alerts")
    assert doc["status"] == "success", doc
    return {a["alertname"]: a for a in doc["data"]["alerts"]}


def _run_job(log: Path, first: int, scales: list[float], pause: float = 0.02) -> None:
    """The training job: a separate process appending Megatron lines, waited for."""
    res = subprocess.run([sys.executable, str(SUPPORT), str(log), str(first),
                          ",".join(str(s) for s in scales), str(pause)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"log writer failed: {res.stdout}{res.stderr}"


# --- promtool check metrics on a live agent ------------------------------------------------------

def test_promtool_check_metrics_on_live_agent(tmp_path: Path) -> None:
    """The real /metrics, with every family populated, passes `promtool check metrics` silently,
    and carries every precision_agent_* metric that alerts.yml uses."""
    promtool = find_binary("promtool")
    logs = tmp_path / "logs"
    logs.mkdir()
    agent, port = start_listening(
        "agent", lambda p: _agent_argv(p, tmp_path / "state", "--watch", str(logs)), tmp_path,
        env=_agent_env())
    base = f"http://127.0.0.1:{port}"
    try:
        # a whole collapsing Megatron run (scale down to 1, then grad norm NaN), from another process
        res = subprocess.run([sys.executable, "-c",
                              "import sys; from pathlib import Path; "
                              "from precision_agent.commands.demo import simulated_job; "
                              "simulated_job(Path(sys.argv[1]), pause=0.005)", str(logs / "train.log")],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr

        def both_firing() -> bool:
            agent.check_alive()
            alerts = _agent_alerts(base)
            return all(alerts.get(n, {}).get("state") == "firing"
                       for n in ("LossScaleAtFloor", "TrainingNonFinite"))

        wait_until(both_firing, 20, "LossScaleAtFloor and TrainingNonFinite firing in the agent",
                   on_timeout=agent.tail)
        status, body = http_get(f"{base}/metrics")
        assert status == 200
        text = body.decode()

        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                               text=True, timeout=30)
        assert (check.returncode, check.stdout + check.stderr) == (0, ""), (
            f"promtool check metrics rc={check.returncode}:\n{check.stdout}{check.stderr}")

        samples: dict[str, int] = {}
        for fam in text_string_to_metric_families(text):
            samples[fam.name] = len(fam.samples)
        empty = [n for n in POPULATED if not samples.get(n)]
        assert not empty, f"families without samples: {empty}\n{text}"

        # declared families count too: dump digests have samples only on hosts with a digest watch
        exposed = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
        exposed |= {fam.name for fam in text_string_to_metric_families(text)}
        # (a counter declared without samples, e.g. hardware faults on a host without any, shows by its
        # family name; its samples would be <name>_total)
        exposed |= {fam.name + "_total" for fam in text_string_to_metric_families(text) if fam.type == "counter"}
        exprs = [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
        # the agent's own names, not the recorded ones that contain them (host:precision_agent_...:10m)
        used = {m for e in exprs for m in re.findall(r"(?<![:\w])precision_agent_[a-z0-9_]+(?![:\w])", e)}
        assert used and used <= exposed, f"alerts.yml uses metrics the agent does not export: {used - exposed}"
    finally:
        stop_all([agent])


# --- the whole stack -----------------------------------------------------------------------------


class Stack:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[Proc] = []
        self.sink: WebhookSink | None = None
        self.agent_url = self.prom_url = self.am_url = ""
        self.am_unavailable = ""   # why Alertmanager could not be run, if it could not
        self.log_file = root / "logs" / "train.log"

    def logs(self) -> str:
        parts = [p.tail() for p in self.procs]
        if self.sink is not None:
            parts.append(f"----- webhook sink received: {json.dumps(self.sink.received, indent=1)[-4000:]}")
        return "\n".join(parts)

    def check_alive(self) -> None:
        for p in self.procs:
            p.check_alive()

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        def checked() -> Any:
            self.check_alive()
            return predicate()
        return wait_until(checked, timeout, what, interval=0.25, on_timeout=self.logs)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus = find_binary("prometheus")
    alertmanager = find_binary("prometheus-alertmanager")
    find_binary("promtool")
    find_binary("amtool")
    s = Stack(tmp_path_factory.mktemp("e2e-stack"))
    (s.root / "logs").mkdir()
    try:
        # 1. the agent, with a watch label (run) that must travel all the way to Alertmanager
        cfg = s.root / "agent.yml"
        cfg.write_text(yaml.safe_dump({
            "resync_interval": "5s",
            "watches": [{"path": str(s.root / "logs"), "labels": {"run": RUN}}],
            "limits": {"nice": 0, "io_idle": False},
        }))
        agent, port = start_listening(
            "agent", lambda p: _agent_argv(p, s.root / "state", "--config", str(cfg)), s.root,
            env=_agent_env())
        s.procs.append(agent)
        s.agent_url = f"http://127.0.0.1:{port}"

        # 2. webhook sink and Alertmanager: page and ticket alerts to two paths of the sink
        wrapper, s.am_unavailable = alertmanager_wrapper(alertmanager)
        alerting: dict[str, Any] = {}
        if not s.am_unavailable:
            s.sink = WebhookSink()
            hook = f"http://127.0.0.1:{s.sink.port}"
            am_cfg = s.root / "alertmanager.yml"
            am_cfg.write_text(yaml.safe_dump({
                "route": {"receiver": "other", "group_by": ["alertname", "agent_alertname", "run"],
                          "group_wait": "0s", "group_interval": "1s", "repeat_interval": "1h",
                          "routes": [{"matchers": ['severity="page"'], "receiver": "pager"},
                                     {"matchers": ['severity="ticket"'], "receiver": "ticket"}]},
                "receivers": [{"name": n, "webhook_configs": [{"url": f"{hook}/{n}", "send_resolved": True}]}
                              for n in ("pager", "ticket", "other")],
            }))
            (s.root / "am").mkdir()
            am, am_port = start_listening("alertmanager", lambda p: [
                *wrapper, alertmanager, f"--config.file={am_cfg}", f"--storage.path={s.root / 'am'}",
                f"--web.listen-address=127.0.0.1:{p}", "--cluster.listen-address=",
                f"--web.external-url=http://127.0.0.1:{p}", "--log.level=info"], s.root)
            s.procs.append(am)
            s.am_url = f"http://127.0.0.1:{am_port}"
            alerting = {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]}

        # 3. Prometheus: 1 s scrape and evaluation, the shipped rules, tmp storage, loopback only
        prom_cfg = s.root / "prometheus.yml"
        prom_cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            **({"alerting": alerting} if alerting else {}),
            "scrape_configs": [{"job_name": JOB,
                                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
        }))
        (s.root / "prom").mkdir()
        prom, prom_port = start_listening("prometheus", lambda p: [
            prometheus, f"--config.file={prom_cfg}", f"--storage.tsdb.path={s.root / 'prom'}",
            f"--web.listen-address=127.0.0.1:{p}", f"--web.external-url=http://127.0.0.1:{p}",
            "--storage.tsdb.retention.time=1h", "--rules.alert.resend-delay=1s", "--log.level=info"],
            s.root)
        s.procs.append(prom)
        s.prom_url = f"http://127.0.0.1:{prom_port}"
        yield s
    finally:
        problems = stop_all(s.procs)
        if s.sink is not None:
            s.sink.close()
        assert not problems, problems


SEL = f'job="{JOB}",run="{RUN}"'


@pytest.fixture(scope="module")
def collapsed(stack: Stack) -> dict[str, float]:
    """Drive the training job: a healthy start seen by Prometheus, then the loss-scale collapse."""
    s = stack
    t0 = time.monotonic()
    # A healthy start, written while Prometheus still waits for its first scrape.
    _run_job(s.log_file, 1, [65536.0] * 3)
    s.wait(lambda: prom_query(s.prom_url, f'up{{job="{JOB}"}} == 1'), 30,
           "Prometheus' first successful scrape of the agent")
    healthy = s.wait(lambda: prom_query(s.prom_url, f"precision_agent_training_loss_scale{{{SEL}}} == 65536"),
                     20, "the healthy loss scale (65536) in Prometheus")
    assert len(healthy) == 1, healthy
    # the decrease counter exists at 0 before the first decrease, so increase() can see the collapse
    assert prom_query(s.prom_url, f"precision_agent_training_loss_scale_decreases_total{{{SEL}}} == 0"), s.logs()
    assert not _firing_prom_alerts(s), s.logs()
    t_healthy = time.monotonic()
    # The collapse: 16 overflow steps halve the scale down to its floor, 1.0.
    _run_job(s.log_file, 4, COLLAPSE)
    return {"start": t0, "healthy": t_healthy, "collapsed": time.monotonic()}


def _firing_prom_alerts(s: Stack) -> list[dict[str, Any]]:
    doc = get_json(f"{s.prom_url}/api/v1/alerts")
    return [a for a in doc["data"]["alerts"] if a["state"] == "firing"]


def _webhook_alerts(s: Stack, path: str) -> list[dict[str, Any]]:
    assert s.sink is not None
    return [a for p in s.sink.payloads(path) if p.get("status") == "firing"
            for a in p.get("alerts", []) if a.get("status") == "firing"]


def _prom_agent_alert(s: Stack) -> list[dict[str, Any]]:
    return [a for a in _firing_prom_alerts(s)
            if a["labels"].get("alertname") == "PrecisionAgentAlertFiring"
            and a["labels"].get("agent_alertname") == "LossScaleAtFloor"]


def test_loss_scale_collapse_fires_in_prometheus(stack: Stack, collapsed: dict[str, float]) -> None:
    """Log line `loss scale: 1.0` -> agent alert -> scraped -> Prometheus rules fire."""
    s = stack
    # 1. the agent's own alert, scraped into Prometheus as precision_agent_alerts
    got = s.wait(lambda: prom_query(
        s.prom_url, f'precision_agent_alerts{{alertname="LossScaleAtFloor",alertstate="firing",{SEL}}} == 1'),
        20, "precision_agent_alerts{alertname=LossScaleAtFloor,alertstate=firing} == 1 in Prometheus")
    assert got[0]["metric"]["severity"] == "page", got
    assert float(got[0]["value"][1]) == 1.0

    # 2. the loss-scale gauge went down to the floor
    floor = s.wait(lambda: prom_query(s.prom_url, f"precision_agent_training_loss_scale{{{SEL}}} == 1"), 10,
                   "precision_agent_training_loss_scale == 1 in Prometheus")
    assert [float(r["value"][1]) for r in floor] == [1.0], floor

    # 3. Prometheus' own rule re-exposes it, with the agent's severity and series labels
    alert = s.wait(lambda: _prom_agent_alert(s), 15,
                   "PrecisionAgentAlertFiring{agent_alertname=LossScaleAtFloor} firing in Prometheus")[0]
    assert alert["labels"]["severity"] == "page", alert
    assert alert["labels"]["run"] == RUN and alert["labels"]["job"] == JOB, alert
    assert "alertstate" not in alert["labels"], alert
    assert alert["annotations"]["summary"].startswith("precision-agent alert LossScaleAtFloor is firing"), alert

    # 4. and Prometheus' LossScaleCollapsing, computed from the agent's decrease counter
    collapsing = s.wait(lambda: [a for a in _firing_prom_alerts(s)
                                 if a["labels"].get("alertname") == "LossScaleCollapsing"],
                        15, "LossScaleCollapsing firing in Prometheus")
    assert collapsing[0]["labels"]["severity"] == "ticket" and collapsing[0]["labels"]["run"] == RUN

    # Nothing else on the Prometheus side is wrong with the agent (down, errors, ...).
    others = {a["labels"]["alertname"] for a in _firing_prom_alerts(s)} - {
        "PrecisionAgentAlertFiring", "LossScaleCollapsing"}
    assert not others, f"unexpected firing alerts {others}\n{s.logs()}"
    print(f"\nstack: healthy series in Prometheus {collapsed['healthy'] - collapsed['start']:.1f}s "
          f"after the start of the test; collapse written -> Prometheus alerts firing "
          f"{time.monotonic() - collapsed['collapsed']:.1f}s")


def test_loss_scale_page_reaches_alertmanager_webhook(stack: Stack, collapsed: dict[str, float]) -> None:
    """Prometheus sends the alerts to Alertmanager, which routes the page and the ticket."""
    s = stack
    if s.am_unavailable:
        if in_ci():
            pytest.fail(f"CI=true but Alertmanager cannot run: {s.am_unavailable}", pytrace=False)
        pytest.skip(f"Alertmanager cannot run: {s.am_unavailable}")
    assert s.sink is not None
    paged = s.wait(lambda: [a for a in _webhook_alerts(s, "/pager")
                            if a["labels"].get("agent_alertname") == "LossScaleAtFloor"],
                   30, "the LossScaleAtFloor page at the webhook's /pager")[0]
    assert paged["labels"]["alertname"] == "PrecisionAgentAlertFiring", paged
    assert paged["labels"]["severity"] == "page" and paged["labels"]["run"] == RUN, paged
    assert paged["generatorURL"].startswith(s.prom_url + "/"), paged  # --web.external-url
    assert paged["annotations"]["runbook_url"].startswith("https://"), paged
    payload = next(p for p in s.sink.payloads("/pager") if p.get("status") == "firing")
    assert payload["externalURL"] == s.am_url, payload

    s.wait(lambda: [a for a in _webhook_alerts(s, "/ticket")
                    if a["labels"].get("alertname") == "LossScaleCollapsing"],
           15, "LossScaleCollapsing at the webhook's /ticket")
    misrouted = [a for a in _webhook_alerts(s, "/ticket") + _webhook_alerts(s, "/other")
                 if a["labels"].get("severity") == "page"]
    assert not misrouted, f"page alerts outside the pager route: {misrouted}"

    # amtool sees the same alert in the live Alertmanager
    res = subprocess.run([find_binary("amtool"), f"--alertmanager.url={s.am_url}", "alert", "query",
                          "-o", "json", "agent_alertname=LossScaleAtFloor"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [a["labels"]["severity"] for a in json.loads(res.stdout)] == ["page"], res.stdout
    print(f"\nstack: collapse written -> first page at the webhook "
          f"{s.sink.first_at['/pager'] - collapsed['collapsed']:.1f}s")
