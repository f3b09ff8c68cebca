"""The shipped Grafana dashboard: well-formed, packaged, and every query real.

Structure is checked offline. Then the real agent follows a collapsing Megatron run (rank-prefixed
lines, a run label) and a real Prometheus scrapes it every second: every metric name a panel
uses must be on the agent's /metrics, every expression (template variables substituted) must be
accepted by Prometheus, every variable query must find the agent, run and rank, and the panels
must show data, except the few listed in MAY_BE_EMPTY with the reason.
"""

from __future__ import annotations

import json
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from support.prom import find_binary, http_get, megatron_line, prom_query, start_listening, stop_all, wait_until

DASHBOARD = Path(__file__).resolve().parents[2] / "exporters" / "grafana" / "precision-agent.json"
JOB = "precision-agent"
RUN = "gpt-dash"
VARIABLES = {"instance", "run", "rank"}
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds"}   # Prometheus adds these to every target
# Panels allowed to be empty on a healthy test run, with why.
MAY_BE_EMPTY = {
    "First bad op": "needs a scanned dump with NaN (precision_agent_dump_first_nonfinite_step)",
    "Fusion suspected": "needs a FusionSuspected alert (two runs labelled fusion on/off)",
    "Errors / s by kind": "shows only kinds with errors (> 0)",
    "Suspect hosts": "needs a SuspectHardware alert (the shipped Prometheus rules and an incident)",
    "NaN origins by host (3 days)": "needs a TrainingNonFiniteOrigin of the shipped Prometheus rules",
    "Hardware evidence (10m)": "needs hardware evidence (a DCGM or npu-exporter target, or a kernel-log fault)",
}
# Series the shipped Prometheus rules (exporters/prometheus/alerts.yml) record, and their alerts
PROM_RULES = yaml.safe_load((Path(__file__).resolve().parents[2] / "exporters" / "prometheus" / "alerts.yml")
                            .read_text())["groups"]
RECORDED = {r["record"] for g in PROM_RULES for r in g["rules"] if "record" in r}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))   # panels inside collapsed rows
    return out


def _queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target."""
    return [(p["title"], t["expr"]) for p in _panels(dash) if p["type"] != "row" for t in p["targets"]]


def concrete(expr: str) -> str:
    """The expression Grafana would send with every variable at "All" (regex .*)."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        assert name in VARIABLES, f"undefined variable ${name} in {expr}"
        return ".*"
    out = re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)
    assert "$" not in out, out
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names of a PromQL expression: identifiers outside strings, matchers, ranges and
    grouping clauses that are not function calls or keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        if m.group() in KEYWORDS or e[m.end():].lstrip().startswith("("):
            continue
        names.add(m.group())
    return names


def test_metric_name_extraction() -> None:
    assert metric_names('sum by (kind) (rate(a_total{x=~"b(c)"}[5m])) > 0 or vector(0)') == {"a_total"}
    assert metric_names("time() - c_seconds{i=\"$i\"} and on(instance) d") == {"c_seconds", "d"}


# --- offline: structure ---------------------------------------------------------------------------

def test_dashboard_structure() -> None:
    dash = _dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] == "precision-agent" and dash["title"]
    assert dash.get("id") is None   # importable into any Grafana: no instance-specific id
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name in VARIABLES:
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["allValue"] == ".*", v
        assert re.fullmatch(rf"label_values\(.+, {name}\)", v["definition"]), v
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), ids
    grid: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):   # no two panels overlap
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in grid, f"{p['title']} overlaps {grid[(x, y)]}"
                grid[(x, y)] = p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}" and t["expr"].strip(), p["title"]
            concrete(t["expr"])   # only known variables
    titles = {p["title"] for p in panels}
    for wanted in ("Firing alerts", "Pending alerts", "Loss", "Loss scale", "Overflow (skipped) steps / s",
                   "NaN/Inf values", "Gradient norm", "First bad op", "Dump files scanned / s",
                   "Log lines read / s", "Errors / s by kind", "Queue and resyncs", "Agent CPU",
                   "Agent memory (RSS)"):
        assert wanted in titles, wanted
    assert set(MAY_BE_EMPTY) <= titles


def test_fusion_panel_shows_both_fusion_alerts() -> None:
    """FusionSuspected comes from the curves (no op) and from dumps (labelled with op, and with the
    watch's job): the panel keeps op and job, and its description covers both."""
    (panel,) = [p for p in _panels(_dashboard()) if p["title"] == "Fusion suspected"]
    (target,) = panel["targets"]
    grouping = re.search(r"max by \(([^)]*)\)", target["expr"])
    assert grouping and {"instance", "job", "run", "rank", "op", "alertstate"} <= {
        g.strip() for g in grouping.group(1).split(",")}
    d = panel["description"]
    assert "precision-fusion-dumps" in d and "fusion=\"off\"" in d and "fusion_switch.cfg" in d


def test_hardware_panels_use_the_shipped_rules() -> None:
    """The suspect-host panels read what alerts.yml records and alerts: no name of their own."""
    by_title = {p["title"]: p for p in _panels(_dashboard())}
    alerts = {r["alert"] for g in PROM_RULES for r in g["rules"] if "alert" in r}
    used = set()
    for title in ("Suspect hosts", "NaN origins by host (3 days)", "Hardware evidence (10m)"):
        for t in by_title[title]["targets"]:
            used |= metric_names(t["expr"])
            for name in re.findall(r'alertname="(\w+)"', t["expr"]):
                assert name in alerts, (title, name)
    assert used and used <= RECORDED | {"ALERTS"}, used - RECORDED


def test_dashboard_is_package_data() -> None:
    shipped = resources.files("precision_agent.exporters").joinpath("grafana/precision-agent.json")
    assert json.loads(shipped.read_text(encoding="utf-8")) == _dashboard()


# --- live: the real agent and a real Prometheus ------------------------------------------------------

class Live:
    def __init__(self, agent_url: str, prom_url: str, procs: list) -> None:
        self.agent_url, self.prom_url, self.procs = agent_url, prom_url, procs

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        def checked() -> Any:
            for p in self.procs:
                p.check_alive()
            return predicate()
        return wait_until(checked, timeout, what, interval=0.25, on_timeout=self.logs)


def _write_run(log: Path) -> None:
    """A Megatron run on rank 0: healthy, a validation, the loss-scale collapse, then NaN grad norm."""
    scales = [65536.0] * 3 + [65536.0 / 2 ** k for k in range(1, 17)]
    with open(log, "a", encoding="utf-8") as f:
        for i, scale in enumerate(scales, start=1):
            f.write("[rank0]:" + megatron_line(i, 100, scale, loss=6.0 - 0.01 * i,
                                               skipped=1 if i > 3 else 0) + "\n")
            if i == 3:
                f.write("[rank0]: validation loss at iteration 3 | lm loss value: 5.990000E+00 | "
                        "lm loss PPL: 399.4 |\n")
        for i in range(len(scales) + 1, len(scales) + 3):
            f.write("[rank0]:" + megatron_line(i, 100, 1.0, grad_norm="nan") + "\n")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    prometheus = find_binary("prometheus")
    root = tmp_path_factory.mktemp("grafana")
    (root / "logs").mkdir()
    cfg = root / "agent.yml"
    cfg.write_text(yaml.safe_dump({"watches": [{"path": str(root / "logs"), "labels": {"run": RUN}}],
                                   "limits": {"nice": 0, "io_idle": False}}))
    procs: list = []
    try:
        agent, port = start_listening("agent", lambda p: [
            sys.executable, "-m", "precision_agent", "run", "--listen", f"127.0.0.1:{p}",
            "--state", str(root / "state"), "--config", str(cfg)], root)
        procs.append(agent)
        _write_run(root / "logs" / "train.log")
        prom_cfg = root / "prometheus.yml"
        prom_cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]}))
        (root / "prom").mkdir()
        prom, prom_port = start_listening("prometheus", lambda p: [
            prometheus, f"--config.file={prom_cfg}", f"--storage.tsdb.path={root / 'prom'}",
            f"--web.listen-address=127.0.0.1:{p}", "--log.level=warn"], root)
        procs.append(prom)
        s = Live(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}", procs)
        # both alerts firing in the agent, then two scrapes of that state (rate() needs two samples)
        s.wait(lambda: prom_query(s.prom_url, 'count(precision_agent_alerts{alertstate="firing"}) >= 2 and on() '
                                  'count_over_time(precision_agent_alerts{alertname="TrainingNonFinite"}[1m]) >= 2'),
               40, "two firing alerts in two scrapes of Prometheus")
        yield s
    finally:
        assert not stop_all(procs)


def _exported(agent_url: str) -> set[str]:
    status, body = http_get(f"{agent_url}/metrics")
    assert status == 200
    fams = list(text_string_to_metric_families(body.decode()))
    # a gauge family the agent declares but has no series of yet (each rank's first non-finite
    # dump, before any NaN) is exported all the same
    return {s.name for fam in fams for s in fam.samples} | {fam.name for fam in fams if fam.type == "gauge"}


@pytest.mark.e2e
def test_every_metric_is_exported_by_the_agent(live: Live) -> None:
    exported = _exported(live.agent_url)
    if not any(n.startswith("process_") for n in exported):
        # not registered by the daemon (yet): the names must at least be the process collector's own
        reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        exported |= {s.name for fam in text_string_to_metric_families(generate_latest(reg).decode())
                     for s in fam.samples}
    used = {name for _, expr in _queries(_dashboard()) for name in metric_names(expr)}
    assert {n for n in used if n.startswith("precision_agent_")}, used
    missing = used - exported - PROMETHEUS_SYNTHETIC - RECORDED - {"ALERTS"}
    assert not missing, f"the dashboard uses metrics the agent does not export: {sorted(missing)}"


@pytest.mark.e2e
def test_variable_queries_find_agent_run_and_rank(live: Live) -> None:
    found = {}
    for v in _dashboard()["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
        assert m, v["definition"]
        rows = prom_query(live.prom_url, f"count by ({m.group(2)}) ({concrete(m.group(1))})")
        found[v["name"]] = sorted(r["metric"].get(m.group(2), "") for r in rows)
    assert found == {"instance": [live.agent_url.removeprefix("http://")], "run": [RUN], "rank": ["0"]}


@pytest.mark.e2e
def test_every_query_is_valid_promql_with_data(live: Live) -> None:
    queries = _queries(_dashboard())
    for title, expr in queries:   # prom_query asserts status == success; a syntax error raises
        prom_query(live.prom_url, concrete(expr))

    def empty() -> list[str]:
        return [f"{title}: {expr}" for title, expr in queries
                if title not in MAY_BE_EMPTY and not prom_query(live.prom_url, concrete(expr))]

    live.wait(lambda: not empty(), 30, "data for every panel")
    by_title = {t: concrete(e) for t, e in reversed(queries)}   # first target of each panel
    value = {t: [float(r["value"][1]) for r in prom_query(live.prom_url, by_title[t])]
             for t in ("Firing alerts", "Paging alerts", "Loss scale", "Agents up", "Training step")}
    assert value["Firing alerts"][0] >= 2 and value["Paging alerts"][0] >= 2, value
    assert value["Loss scale"] == [1.0] and value["Agents up"] == [1.0] and value["Training step"] == [21.0], value
    table = prom_query(live.prom_url, by_title["Active alerts"])
    assert {r["metric"]["alertname"] for r in table} >= {"LossScaleAtFloor", "TrainingNonFinite"}, table
    assert all(r["metric"].get("run") == RUN and r["metric"].get("rank") == "0" for r in table), table
    nonfinite = prom_query(live.prom_url, 'sum by (metric) (precision_agent_training_nonfinite_values_total)')
    assert {r["metric"]["metric"]: float(r["value"][1]) for r in nonfinite}["grad_norm"] == 2.0
