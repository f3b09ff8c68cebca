"""Runbooks (docs/runbooks/): every shipped rule's runbook_url resolves to a file in the repository.

- agent rules (rules/*.yml) say ``runbook_url: "{{ $runbook_base }}/<alert>.md"``; the base is the
  config's ``runbook_base_url``, by default a file:// URL of docs/runbooks (the installed copy in a
  plain install: tests/commands/test_packaging_and_demo.py);
- the daemon renders the URL with the config's base (a real agent process, a real log);
- the Prometheus rules (exporters/prometheus/alerts.yml) use one sed-able base, named in the
  file's header; replacing it changes every URL and promtool's unit tests still pass.
"""

from __future__ import annotations

import re
import subprocess
import urllib.parse
from pathlib import Path

import pytest
import yaml

from support.agent import AgentProcess, write_megatron
from conftest import wait_for
from support.prom import PROM_DIR, REPO, find_binary

from precision_agent.config import ConfigError, load_config
from precision_agent.model import LOSS, Sample, SourcePos, make_labels
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import default_rules_dir, default_runbook_base, load_rules

RUNBOOKS = REPO / "docs" / "runbooks"
SECTIONS = ("## What fired", "## How to confirm", "## What to do", "## When it is normal")


def _agent_rules() -> list[tuple[str, str]]:
    """(alert name, runbook_url template) of every shipped agent rule."""
    return [(r.name, r.spec.annotations.get("runbook_url", "")) for r in load_rules([default_rules_dir()]).rules]


def _prom_alerts() -> list[dict]:
    doc = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _prom_base() -> str:
    m = re.search(r"^#\s+RUNBOOK_BASE: (\S+)$", (PROM_DIR / "alerts.yml").read_text(), re.M)
    assert m, "alerts.yml must name its runbook base in its header (# RUNBOOK_BASE: URL)"
    return m.group(1)


def _file_of(url: str) -> Path:
    parsed = urllib.parse.urlparse(url)
    assert parsed.scheme == "file", url
    return Path(urllib.parse.unquote(parsed.path))


def test_default_base_is_the_repository_folder() -> None:
    assert default_runbook_base() == RUNBOOKS.resolve().as_uri()


def test_every_agent_rule_links_its_own_runbook() -> None:
    rules = _agent_rules()
    assert len(rules) >= 27
    for name, template in rules:
        assert template == "{{ $runbook_base }}/" + name + ".md", (name, template)


def test_every_agent_rule_url_rendered_with_the_default_base_is_a_file() -> None:
    for rule in load_rules([default_rules_dir()]).rules:
        url = rule.annotate(make_labels(run="r", rank="0"), 1.0, 5, None, {})["runbook_url"]
        path = _file_of(url)
        assert path.is_file() and path.parent == RUNBOOKS.resolve(), (rule.name, url)


def test_pipeline_renders_the_base_it_was_given() -> None:
    """Through the real pipeline: a NaN loss pages with the configured base, or the default one."""
    for base, expect in (("", default_runbook_base()), ("https://wiki.example/runbooks", "https://wiki.example/runbooks")):
        p = Pipeline(load_rules([default_rules_dir()], runbook_base=base))
        p.process([Sample(make_labels(run="r1", rank="0"), LOSS, float("nan"), 7, SourcePos("/t.log", 7), time=1.0)])
        p.tick(1.0)
        alert = next(a for a in p.alerts.alerts.values() if a.rule == "TrainingNonFinite")
        assert alert.annotations["runbook_url"] == f"{expect}/TrainingNonFinite.md"


def test_daemon_takes_the_base_from_its_config(tmp_path: Path) -> None:
    logs, state = tmp_path / "logs", tmp_path / "state"
    logs.mkdir()
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump({"watches": [{"path": str(logs)}],
                                   "runbook_base_url": "https://wiki.example/runbooks/"}))
    agent = AgentProcess(logs, state, "--config", str(cfg)).start()
    try:
        write_megatron(logs / "train.log", 1, 3, grad="nan")   # three NaN grad norms in a row: a page
        write_megatron(logs / "train.log", 4, 4, scale="1.0")
        alerts = wait_for(lambda: [a for a in agent.alerts() if a["alertname"] == "TrainingNonFinite"
                                   and a["state"] == "firing"], 20, what=f"TrainingNonFinite; {agent.stderr()}")
        assert alerts[0]["annotations"]["runbook_url"] == "https://wiki.example/runbooks/TrainingNonFinite.md"
        for a in agent.alerts():  # every alert takes the one base
            assert a["annotations"]["runbook_url"].startswith("https://wiki.example/runbooks/"), a
    finally:
        agent.stop()


def test_runbook_base_url_must_be_an_absolute_url(tmp_path: Path) -> None:
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump({"watches": [{"path": str(tmp_path)}], "runbook_base_url": "wiki/runbooks"}))
    with pytest.raises(ConfigError, match="runbook_base_url"):
        load_config(cfg)


def test_every_prometheus_alert_links_a_file_under_one_base() -> None:
    base = _prom_base()
    alerts = _prom_alerts()
    for r in alerts:
        url = r["annotations"]["runbook_url"]
        assert url == f"{base}/{r['alert']}.md", url
        assert (RUNBOOKS / f"{r['alert']}.md").is_file(), url
    text = "".join((PROM_DIR / n).read_text() for n in ("alerts.yml", "alerts_test.yml", "alerts_hosts_test.yml"))
    urls = re.findall(r"runbook_url: \"([^\"]+)\"", text)
    assert urls and all(u.startswith(base + "/") for u in urls), urls


def test_every_runbook_has_the_four_sections_and_is_indexed() -> None:
    names = {n for n, _ in _agent_rules()} | {r["alert"] for r in _prom_alerts()}
    index = (RUNBOOKS / "README.md").read_text()
    for name in names:
        text = (RUNBOOKS / f"{name}.md").read_text()
        assert text.startswith(f"# {name}"), name
        for s in SECTIONS:
            assert s in text, (name, s)
        assert f"]({name}.md)" in index, f"{name} missing from docs/runbooks/README.md"
    for link in re.findall(r"\]\(([A-Za-z0-9]+\.md)\)", index):
        assert (RUNBOOKS / link).is_file(), link


@pytest.mark.e2e
def test_prometheus_base_is_sedable(tmp_path: Path) -> None:
    """One substitution moves every URL; promtool's unit tests pass on the result."""
    base, new = _prom_base(), "https://wiki.example/runbooks"
    for name in ("alerts.yml", "alerts_test.yml"):
        (tmp_path / name).write_text((PROM_DIR / name).read_text().replace(base, new))
    assert base not in (tmp_path / "alerts.yml").read_text()
    promtool = find_binary("promtool")
    res = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    # the unit tests do check the URL: the old base in the tests alone fails (one test case that
    # expects a URL is enough to show it; all of them passed with the new base just above)
    doc = yaml.safe_load((PROM_DIR / "alerts_test.yml").read_text())
    case = next(c for c in doc["tests"] if base in yaml.safe_dump(c))
    (tmp_path / "old_base_test.yml").write_text(yaml.safe_dump({**doc, "tests": [case]}, sort_keys=False))
    res = subprocess.run([promtool, "test", "rules", "old_base_test.yml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "runbook_url" in res.stdout + res.stderr, res.stdout + res.stderr


def test_commands_in_runbooks_exist_with_their_flags() -> None:
    """Every `precision-agent CMD --flag ...` a runbook tells the on-call to run is a real command
    of ours, with flags its --help lists."""
    import sys
    used: dict[tuple[str, ...], set[str]] = {}
    for md in RUNBOOKS.glob("*.md"):
        for span in re.findall(r"`(precision-agent [^`]+)`", md.read_text()):
            words = span.split()[1:]
            cmd = tuple(words[:2]) if words[0] in ("rules", "fusion") else (words[0],)
            used.setdefault(cmd, set()).update(w.split("=")[0] for w in words if w.startswith("--"))
    assert {("replay",), ("scan",), ("compare",)} <= set(used), used
    for cmd, flags in used.items():
        res = subprocess.run([sys.executable, "-m", "precision_agent", *cmd, "--help"], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, (cmd, res.stderr)
        for flag in flags:
            assert flag in res.stdout, (cmd, flag)
