"""The shipped Alertmanager configuration (exporters/alertmanager/alertmanager.yml).

- ``amtool check-config`` accepts it;
- ``amtool config routes test --verify.receivers`` sends each kind of alert to the receiver the
  docs promise (page, critical, ticket, warning, info, origin, no severity), and a wrong
  expectation fails;
- a real Alertmanager (Debian's 0.25, 127.0.0.1) running the shipped routes and inhibition rules
  marks the propagated copies of a non-finite incident, an agent's own silence while it is down,
  and the tickets of a paged run as suppressed, and notifies one page per run, naming the origin;
  a hardware suspect (suspect="hardware", SuspectHardware) goes to the infra receiver instead.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from typing import Any, Iterator

import pytest
import yaml

from support.prom import REPO, find_binary, get_json, running_alertmanager, wait_until
from support.prom import WebhookSink

AM_DIR = REPO / "exporters" / "alertmanager"
CONFIG = AM_DIR / "alertmanager.yml"
JOB = "gpt3"


def _config() -> dict[str, Any]:
    return yaml.safe_load(CONFIG.read_text())


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_binary("amtool"), *args], capture_output=True, text=True, timeout=60)


# --- static checks of the YAML (no binary needed) -----------------------------------------------

def test_grouping_receivers_and_inhibit_rules_are_as_documented() -> None:
    cfg = _config()
    route = cfg["route"]
    assert route["group_by"] == ["job", "run"]
    assert {r["name"] for r in cfg["receivers"]} == {"page", "ticket", "null", "infra"}
    for r in cfg["receivers"]:  # placeholders reach nothing outside this host
        for hook in r.get("webhook_configs", []):
            assert hook["url"].startswith("http://127.0.0.1:"), hook
    rules = [(tuple(r["source_matchers"]), tuple(r["target_matchers"]), tuple(r["equal"]))
             for r in cfg["inhibit_rules"]]
    origin = 'alertname=~".+Origin"'
    assert ((origin,), ('alertname=~"TrainingNonFinite|DumpNonFinite"',), ("job", "run")) in rules
    assert ((origin,), ('alertname="PrecisionAgentAlertFiring"',
                        'agent_alertname=~"TrainingNonFinite|DumpNonFinite"'), ("job", "run")) in rules
    assert (('alertname="PrecisionAgentDown"',), ('alertname=~"PrecisionAgentNoLogProgress|TrainingStalled"',),
            ("instance",)) in rules
    assert (('severity=~"page|critical"', 'run=~".+"', 'suspect!="hardware"'),
            ('severity=~"ticket|warning"', 'suspect!="hardware"'), ("job", "run")) in rules
    # the names the inhibition relies on exist in the shipped Prometheus and agent rules
    prom = yaml.safe_load((REPO / "exporters" / "prometheus" / "alerts.yml").read_text())
    prom_names = {r.get("alert") for g in prom["groups"] for r in g["rules"]}
    assert {"PrecisionAgentDown", "PrecisionAgentNoLogProgress", "PrecisionAgentAlertFiring"} <= prom_names
    agent_names = {r["alert"] for f in (REPO / "rules").glob("*.yml")
                   for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]}
    assert {"TrainingNonFinite", "DumpNonFinite", "TrainingStalled"} <= agent_names


# --- amtool ----------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_amtool_check_config() -> None:
    res = amtool("check-config", str(CONFIG))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout and "5 inhibit rules" in res.stdout, res.stdout + res.stderr


ROUTES = [
    ("page", ["alertname=TrainingNonFinite", "severity=page", f"job={JOB}", "run=r1", "rank=3"]),
    ("critical", ["alertname=MyCriticalRule", "severity=critical", "run=r1"]),
    ("ticket", ["alertname=LossScaleDecreasing", "severity=ticket", "run=r1"]),
    ("warning", ["alertname=PrecisionAgentDown", "severity=warning", "instance=h1:19400"]),
    ("info", ["alertname=SomeInfo", "severity=info", "run=r1"]),
    ("origin", ["alertname=TrainingNonFiniteOrigin", f"job={JOB}", "run=r1", "instance=h7:19400", "rank=5"]),
    ("prometheus-copy", ["alertname=PrecisionAgentAlertFiring", "agent_alertname=LossScaleAtFloor",
                         "severity=page", "run=r1"]),
    ("default", ["alertname=NoSeverity", "run=r1"]),
    # hardware or numerics (docs/alertmanager.md): hardware suspects to infra, the rest as before
    ("origin-hardware", ["alertname=TrainingNonFiniteOrigin", "suspect=hardware", "severity=page", f"job={JOB}",
                         "run=r1", "instance=h7:19400", "rank=5"]),
    ("origin-numerics", ["alertname=TrainingNonFiniteOrigin", "suspect=numerics", "severity=page", f"job={JOB}",
                         "run=r1", "instance=h7:19400", "rank=5"]),
    ("origin-unknown", ["alertname=TrainingNonFiniteOrigin", "suspect=unknown", "severity=page", f"job={JOB}",
                        "run=r1", "instance=h7:19400", "rank=5"]),
    ("agent-hardware", ["alertname=LossScaleCollapse", "suspect=hardware", "severity=page", "run=r1"]),
    ("agent-numerics-ticket", ["alertname=TrainingLossDivergence", "suspect=numerics", "severity=ticket",
                               "run=r1"]),
    ("prometheus-copy-hardware", ["alertname=PrecisionAgentAlertFiring", "agent_alertname=TrainingNonFinite",
                                  "suspect=hardware", "severity=page", "run=r1"]),
    ("suspect-host", ["alertname=SuspectHardware", "severity=page", "host=h7"]),
    ("xid", ["alertname=GpuHardwareFault", "severity=page", "device=0000:3b:00", "code=79", "instance=h7"]),
    ("xid-prometheus-copy", ["alertname=PrecisionAgentAlertFiring", "agent_alertname=GpuHardwareFault",
                             "severity=page", "device=0000:3b:00", "code=79", "instance=h7:19400"]),
    ("info-hardware", ["alertname=SomeInfo", "severity=info", "suspect=hardware"]),
]
EXPECTED = {"page": "page", "critical": "page", "ticket": "ticket", "warning": "ticket", "info": "null",
            "origin": "page", "prometheus-copy": "page", "default": "ticket",
            "origin-hardware": "infra", "origin-numerics": "page", "origin-unknown": "page", "agent-hardware": "infra",
            "agent-numerics-ticket": "ticket", "prometheus-copy-hardware": "infra", "suspect-host": "infra",
            "xid": "infra", "xid-prometheus-copy": "infra", "info-hardware": "null"}


@pytest.mark.e2e
@pytest.mark.parametrize("case, labels", ROUTES, ids=[c for c, _ in ROUTES])
def test_amtool_routes(case: str, labels: list[str]) -> None:
    res = amtool("config", "routes", "test", f"--config.file={CONFIG}",
                 f"--verify.receivers={EXPECTED[case]}", *labels)
    assert res.returncode == 0, f"{case}: {res.stdout}{res.stderr}"
    assert res.stdout.strip() == EXPECTED[case], res.stdout


@pytest.mark.e2e
def test_amtool_routes_test_can_fail() -> None:
    res = amtool("config", "routes", "test", f"--config.file={CONFIG}", "--verify.receivers=ticket",
                 "alertname=TrainingNonFinite", "severity=page")
    assert res.returncode != 0 and "did not match" in res.stdout + res.stderr, res.stdout + res.stderr


# --- a real Alertmanager with the shipped configuration --------------------------------------------

@pytest.fixture(scope="module")
def shipped_am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WebhookSink]]:
    """Alertmanager running the shipped file with two changes only: the placeholder webhooks
    point at a sink in this process, and group_wait/group_interval are 1s instead of 30s/5m."""
    sink = WebhookSink()
    cfg = _config()
    for r in cfg["receivers"]:
        for hook in r.get("webhook_configs", []):
            path = hook["url"].split("/", 3)[3]
            hook["url"] = f"http://127.0.0.1:{sink.port}/{path}"
    cfg["route"].update(group_wait="1s", group_interval="1s")
    try:
        with running_alertmanager(cfg, tmp_path_factory.mktemp("am-shipped")) as url:
            yield url, sink
    finally:
        sink.close()


def _alert(name: str, **labels: str) -> dict[str, Any]:
    return {"labels": {"alertname": name, **labels}, "annotations": {"summary": name},
            "generatorURL": "http://127.0.0.1/api/v1/alerts"}


def _post(url: str, alerts: list[dict[str, Any]]) -> None:
    req = urllib.request.Request(f"{url}/api/v2/alerts", data=json.dumps(alerts).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def _key(labels: dict[str, str]) -> tuple[str, ...]:
    return (labels["alertname"], labels.get("run", ""), labels.get("instance", ""), labels.get("rank", ""),
            labels.get("agent_alertname", ""))


SUPPRESSED = {
    # (a) copies of run r1's incident, pushed by agents and re-raised by Prometheus
    _key({"alertname": "TrainingNonFinite", "run": "r1", "instance": "h1:19400", "rank": "0"}),
    _key({"alertname": "TrainingNonFinite", "run": "r1", "instance": "h2:19400", "rank": "9"}),
    _key({"alertname": "DumpNonFinite", "run": "r1", "instance": "h2:19400", "rank": "9"}),
    _key({"alertname": "PrecisionAgentAlertFiring", "run": "r1", "instance": "h3:19400", "rank": "17",
          "agent_alertname": "TrainingNonFinite"}),
    # (c) the ticket of a paged run
    _key({"alertname": "LossScaleDecreasing", "run": "r1", "instance": "h1:19400", "rank": "0"}),
    _key({"alertname": "TrainingLossStuck", "run": "r2", "instance": "h1:19400", "rank": "0"}),
    # (a) copies of run r5's incident, whose origin is a hardware suspect
    _key({"alertname": "TrainingNonFinite", "run": "r5", "instance": "h8:19400", "rank": "3"}),
    # (b) the silence of an agent that is down
    _key({"alertname": "PrecisionAgentNoLogProgress", "run": "r4", "instance": "h5:19400", "rank": "0"}),
    _key({"alertname": "TrainingStalled", "run": "r4", "instance": "h5:19400", "rank": "1"}),
}


@pytest.mark.e2e
def test_shipped_inhibition_in_a_real_alertmanager(shipped_am: tuple[str, WebhookSink]) -> None:
    url, sink = shipped_am
    page, ticket = {"severity": "page", "job": JOB}, {"severity": "ticket", "job": JOB}
    alerts = [
        # run r1: a NaN on h2 rank 9 first, propagated to every rank; the origin rule names it
        _alert("TrainingNonFinite", run="r1", instance="h1:19400", rank="0", metric="loss", **page),
        _alert("TrainingNonFinite", run="r1", instance="h2:19400", rank="9", metric="loss", **page),
        _alert("DumpNonFinite", run="r1", instance="h2:19400", rank="9", op="Functional.linear.3.forward", **page),
        _alert("PrecisionAgentAlertFiring", run="r1", instance="h3:19400", rank="17",
               agent_alertname="TrainingNonFinite", **page),
        _alert("TrainingNonFiniteOrigin", run="r1", instance="h2:19400", rank="9", **page),
        _alert("LossScaleDecreasing", run="r1", instance="h1:19400", rank="0", **ticket),
        # ... and a hardware suspect's ticket of r1: the owner's page does not silence what infra must hear
        _alert("DumpDivergence", run="r1", instance="h2:19400", rank="9", suspect="hardware", **ticket),
        # run r2 on the same hosts: its own NaN, no origin yet: pages on its own
        _alert("TrainingNonFinite", run="r2", instance="h1:19400", rank="0", metric="grad_norm", **page),
        _alert("TrainingLossStuck", run="r2", instance="h1:19400", rank="0", severity="warning", job=JOB),
        # run r3: only a ticket, nothing pages: it is notified
        _alert("LossScaleDecreasing", run="r3", instance="h4:19400", rank="0", **ticket),
        # agent on h5 down: its silence is not news; h6's agent is up and its silence is
        _alert("PrecisionAgentDown", instance="h5:19400", job="precision-agent", severity="warning"),
        _alert("PrecisionAgentNoLogProgress", run="r4", instance="h5:19400", rank="0", **ticket),
        _alert("TrainingStalled", run="r4", instance="h5:19400", rank="1", severity="warning", job=JOB),
        _alert("PrecisionAgentNoLogProgress", run="r4", instance="h6:19400", rank="0", **ticket),
        _alert("SomeInfo", run="r3", instance="h4:19400", severity="info", job=JOB),
        # run r5: its origin h9 had an Xid 79 near the first bad step: infra is paged, not the
        # owner; its copies are inhibited all the same. h9 is a suspect host too (one notification)
        _alert("TrainingNonFinite", run="r5", instance="h8:19400", rank="3", metric="loss", **page),
        _alert("TrainingNonFiniteOrigin", run="r5", instance="h9:19400", rank="7", suspect="hardware", **page),
        _alert("SuspectHardware", host="h9", severity="page"),
    ]
    _post(url, alerts)

    def states() -> dict[tuple[str, ...], str] | None:
        got = {_key(a["labels"]): a["status"]["state"] for a in get_json(f"{url}/api/v2/alerts")}
        # inhibition is evaluated as groups flush: wait until every alert was judged
        if len(got) < len(alerts) or any(s == "unprocessed" for s in got.values()):
            return None
        if any(got.get(k) != "suppressed" for k in SUPPRESSED):
            return None
        return got

    got = wait_until(states, 20, "the shipped inhibition rules to suppress the copies")
    active = {k for k, s in got.items() if s == "active"}
    assert active == {_key(a["labels"]) for a in alerts} - SUPPRESSED, got
    for a in get_json(f"{url}/api/v2/alerts"):
        if _key(a["labels"]) in SUPPRESSED:
            assert a["status"]["inhibitedBy"], a

    def notified(path: str, run: str) -> list[set[str]]:
        return [{a["labels"]["alertname"] for a in p["alerts"]} for p in sink.payloads(path)
                if p["groupLabels"].get("run", "") == run]

    # one page per run: r1 names only its origin (h2, rank 9), r2 its own NaN
    r1 = wait_until(lambda: notified("/precision-agent/page", "r1"), 20, "the page of run r1")
    assert r1 == [{"TrainingNonFiniteOrigin"}], r1
    origin = next(a for p in sink.payloads("/precision-agent/page") for a in p["alerts"]
                  if a["labels"]["alertname"] == "TrainingNonFiniteOrigin")
    assert (origin["labels"]["instance"], origin["labels"]["rank"]) == ("h2:19400", "9")
    r2 = wait_until(lambda: notified("/precision-agent/page", "r2"), 20, "the page of run r2")
    assert r2 == [{"TrainingNonFinite"}], r2
    r3 = wait_until(lambda: notified("/precision-agent/ticket", "r3"), 20, "the ticket of run r3")
    assert r3 == [{"LossScaleDecreasing"}], r3
    r4 = wait_until(lambda: notified("/precision-agent/ticket", "r4"), 20, "the ticket of run r4")
    assert r4 == [{"PrecisionAgentNoLogProgress"}], r4  # h6's only; h5's agent is down
    down = wait_until(lambda: notified("/precision-agent/ticket", ""), 20, "the agent-down ticket")
    assert down == [{"PrecisionAgentDown"}], down
    # run r1's ticket group is fully inhibited: by the time every other group has been
    # notified (above), it has flushed too, with nothing to send; info goes nowhere
    assert not notified("/precision-agent/ticket", "r1"), sink.payloads("/precision-agent/ticket")
    assert not any(a["labels"]["alertname"] == "SomeInfo" for p in sink.payloads() for a in p["alerts"])
    # the hardware suspect: infra gets the origin of r5 and the host, the owner's page nothing of r5
    r5 = wait_until(lambda: notified("/precision-agent/infra", "r5"), 20, "the infra page of run r5")
    assert r5 == [{"TrainingNonFiniteOrigin"}], r5
    host = wait_until(lambda: [p for p in sink.payloads("/precision-agent/infra") if p["groupLabels"] == {"host": "h9"}],
                      20, "the SuspectHardware notification of h9")
    assert [{a["labels"]["alertname"] for a in p["alerts"]} for p in host] == [{"SuspectHardware"}], host
    assert not notified("/precision-agent/page", "r5"), sink.payloads("/precision-agent/page")
    r1_infra = wait_until(lambda: notified("/precision-agent/infra", "r1"), 20, "the infra ticket of run r1")
    assert r1_infra == [{"DumpDivergence"}], r1_infra
