"""The shipped Prometheus rules (exporters/prometheus/alerts.yml), checked by the real promtool.

- ``promtool check rules`` accepts the file (Prometheus 2.42 syntax, valid PromQL, templates);
- ``promtool test rules alerts_test.yml alerts_hosts_test.yml`` passes: every alert fires, does not fire,
  honours `for:` (the second file evaluates every 5m: SuspectHardware's windows are days long);
- the unit tests can fail: a deliberately wrong expectation makes promtool fail;
- ``promtool check config`` accepts a scrape config that loads the file.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

try:
    from support.prom import PROM_DIR, find_binary
except ImportError:  # tests/ became a package
    from tests.support.prom import PROM_DIR, find_binary

ALERTS = PROM_DIR / "alerts.yml"
ALERTS_TEST = PROM_DIR / "alerts_test.yml"
UNIT_TESTS = (ALERTS_TEST, PROM_DIR / "alerts_hosts_test.yml")
SEVERITIES = {"page", "warning", "ticket"}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # the unit tests take ~25 s of CPU in all: a generous bound, for a loaded 2-core host
    return subprocess.run([find_binary("promtool"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def _rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _unit_tests() -> list[dict]:
    return [case for f in UNIT_TESTS for case in yaml.safe_load(f.read_text())["tests"]]


def _alert_tests() -> list[dict]:
    return [t for case in _unit_tests() for t in case.get("alert_rule_test", [])]


# --- static checks of the YAML (no binary needed) -----------------------------------------------

def test_rules_are_complete_and_within_prometheus_2_42() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        # only keys Prometheus 2.42 knows: a group-level query_offset (newer servers) is rejected
        assert set(group) <= {"name", "interval", "rules", "limit"}, group["name"]
    alerts = [r for r in _rules() if "alert" in r]
    names = {r["alert"] for r in alerts}
    assert {"PrecisionAgentAlertFiring", "PrecisionAgentDown", "PrecisionAgentErrors",
            "PrecisionAgentNoLogProgress", "LossScaleCollapsing"} <= names
    assert any(r.get("record") == "job:precision_agent_training_overflow_steps:rate5m" for r in _rules())
    for r in alerts:
        assert {"summary", "description", "runbook_url"} <= set(r.get("annotations", {})), r["alert"]
        assert r["annotations"]["runbook_url"].startswith("https://"), r["alert"]
        if r["alert"] == "PrecisionAgentAlertFiring":
            # severity must come from the agent's own label, not be overwritten here
            assert "severity" not in r.get("labels", {})
        else:
            assert r["labels"]["severity"] in SEVERITIES, r["alert"]
    down = next(r for r in alerts if r["alert"] == "PrecisionAgentDown")
    assert down["for"] == "5m"


def test_every_alert_has_firing_and_quiet_unit_tests() -> None:
    tested: dict[str, set[bool]] = {}
    for t in _alert_tests():
        tested.setdefault(t["alertname"], set()).add(bool(t.get("exp_alerts")))
    for r in _rules():
        if "alert" in r:
            assert tested.get(r["alert"]) == {True, False}, (
                f"{r['alert']}: alerts_test.yml needs a case where it fires and one where it does not")
    exprs = [e["expr"] for case in _unit_tests() for e in case.get("promql_expr_test", [])]
    for r in _rules():
        if "record" in r:
            assert any(re.match(rf"{re.escape(r['record'])}\b", e) for e in exprs), (
                f"recording rule {r['record']} has no promql_expr_test")


# --- promtool ------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_promtool_check_rules() -> None:
    res = promtool("check", "rules", str(ALERTS))
    assert res.returncode == 0, res.stdout + res.stderr
    n = len(_rules())
    assert f"SUCCESS: {n} rules found" in res.stdout, res.stdout + res.stderr


@pytest.mark.e2e
def test_promtool_test_rules() -> None:
    res = promtool("test", "rules", *(f.name for f in UNIT_TESTS), cwd=PROM_DIR)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout and "FAILED" not in res.stdout, res.stdout + res.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("old, new", [
    # the wrong alert fires: r2 had only 3 decreases
    ("exp_labels: {severity: ticket, job: precision-agent, instance: \"h1:19400\", run: r1}\n"
     "            exp_annotations:\n              summary: \"Loss scale decreased",
     "exp_labels: {severity: ticket, job: precision-agent, instance: \"h1:19400\", run: r2}\n"
     "            exp_annotations:\n              summary: \"Loss scale decreased"),
    # PrecisionAgentDown claimed to fire before its 5m `for:` has passed
    ("      - eval_time: 5m30s\n        alertname: PrecisionAgentDown",
     "      - eval_time: 3m\n        alertname: PrecisionAgentDown"),
    # severity page instead of the agent's label
    ("exp_labels: {severity: ticket, job: precision-agent, instance: \"h1:19400\", run: r1, "
     "agent_alertname: TrainingNonFinite}",
     "exp_labels: {severity: page, job: precision-agent, instance: \"h1:19400\", run: r1, "
     "agent_alertname: TrainingNonFinite}"),
    # the origin on hA, next to its GPU's Xid 79, claimed to be a numerics (owner's) incident
    ("exp_labels: {severity: page, origin: \"true\", suspect: hardware, job: precision-agent, instance: \"hA:19400\", "
     "run: r1, rank: \"0\"}",
     "exp_labels: {severity: page, origin: \"true\", suspect: unknown, job: precision-agent, instance: \"hA:19400\", "
     "run: r1, rank: \"0\"}"),
], ids=["wrong-labels", "for-not-elapsed", "wrong-severity", "wrong-suspect"])
def test_promtool_test_rules_can_fail(tmp_path: Path, old: str, new: str) -> None:
    """A deliberately wrong expectation must make `promtool test rules` fail (rc != 0). Only the
    test case the mutation changes is run (the others' outcome does not change; the whole file
    is test_promtool_test_rules'), unchanged first: it passes alone, so the mutation is what fails."""
    text = ALERTS_TEST.read_text()
    assert old in text, "the mutation no longer matches alerts_test.yml; update this test"
    doc, bad = yaml.safe_load(text), yaml.safe_load(text.replace(old, new, 1))
    changed = [i for i, (a, b) in enumerate(zip(doc["tests"], bad["tests"])) if a != b]
    assert len(changed) == 1 and len(doc["tests"]) == len(bad["tests"]), changed
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    for name, tests in (("case.yml", doc["tests"]), ("mutant.yml", bad["tests"])):
        (tmp_path / name).write_text(yaml.safe_dump({**bad, "tests": [tests[changed[0]]]}, sort_keys=False))
    res = promtool("test", "rules", "case.yml", cwd=tmp_path)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
    res = promtool("test", "rules", "mutant.yml", cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    # a failed comparison (exp/got), not a file that did not load
    assert "FAILED" in out and "exp:" in out and "got:" in out, out


@pytest.mark.e2e
def test_promtool_check_rules_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(ALERTS.read_text().replace(
        "increase(precision_agent_errors_total[10m]) > 0",
        "increase(precision_agent_errors_total[10m] > 0"))
    res = promtool("check", "rules", str(bad))
    assert res.returncode != 0, res.stdout + res.stderr


@pytest.mark.e2e
def test_promtool_check_config_with_rules(tmp_path: Path) -> None:
    """A minimal operator scrape config that loads the shipped rules is valid as a whole."""
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "precision-agent",
                            "static_configs": [{"targets": ["127.0.0.1:19400"]}]}],
    }))
    res = promtool("check", "config", str(cfg))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in res.stdout + res.stderr, res.stdout + res.stderr
