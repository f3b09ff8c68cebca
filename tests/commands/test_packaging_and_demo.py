"""A plain (non-editable) install carries the rule files; `demo` shows a firing alert quickly."""

import os
import re
import subprocess
import sys

from conftest import free_port


def test_plain_install_carries_rules_and_exporter_assets(tmp_path, plain_install):
    target, proc = plain_install   # made once per session, shared with tests/kernels/test_kernels.py
    assert proc.returncode == 0, proc.stderr
    # a clean build: no setuptools deprecation (license table) or "absent from packages" warnings
    build_warnings = [ln for ln in proc.stderr.splitlines() if "BuildBackendWarning" in ln or "eprecat" in ln]
    assert not build_warnings, proc.stderr
    rules = list((target / "precision_agent" / "rules").glob("*.yml"))
    assert (target / "precision_agent" / "rules" / "tests" / "training_test.yml").is_file()
    assert list((target / "precision_agent" / "exporters" / "grafana").glob("*.json"))
    assert list((target / "precision_agent" / "exporters" / "prometheus").glob("*.yml"))
    assert (target / "precision_agent" / "readers" / "metric_map.yml").is_file()  # the shipped metric map
    assert rules, "no rule files in the installed package"
    # their parse at build time (engine/rulefile.py shipped_parsed): without it every command parses YAML
    assert (target / "precision_agent" / "rules" / "parsed.jsonl").is_file()
    env = {**os.environ, "PYTHONPATH": str(target)}
    check = subprocess.run([sys.executable, "-m", "precision_agent", "rules", "check"], capture_output=True,
                           text=True, timeout=60, env=env, cwd=tmp_path)
    assert check.returncode == 0 and str(target) in check.stdout, check.stdout + check.stderr
    # the shipped Alertmanager configuration is data beside the module of the same name, which
    # still imports; the runbooks are installed and are what the rules link to by default
    assert (target / "precision_agent" / "exporters" / "alertmanager" / "alertmanager.yml").is_file()
    probe = subprocess.run([sys.executable, "-c", (
        "import urllib.parse, pathlib\n"
        "import precision_agent.exporters.alertmanager as am\n"
        "from precision_agent.engine.rulefile import default_rules_dir, load_rules\n"
        "from precision_agent.model import make_labels\n"
        "print(am.__file__, am.AlertmanagerPusher.__name__)\n"
        "for r in load_rules([default_rules_dir()]).rules:\n"
        "    url = r.annotate(make_labels(run='r'), 1.0, 1, None, {})['runbook_url']\n"
        "    path = pathlib.Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))\n"
        "    assert url.startswith('file://') and path.is_file(), url\n"
        "    print(path)\n")], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    lines = probe.stdout.splitlines()
    assert lines[0].endswith("exporters/alertmanager.py AlertmanagerPusher"), lines[0]
    runbooks = target / "precision_agent" / "runbooks"
    assert len(lines) > 27 and all(ln.startswith(str(runbooks) + "/") for ln in lines[1:]), probe.stdout


def test_demo_fires_within_10_seconds():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-u", "-m", "precision_agent", "demo", "--duration", "25",
                             "--listen", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen: dict[str, float] = {}
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            m = re.match(r"\[\s*([\d.]+)s\] FIRING\s+(\w+)", line)
            if m:
                seen[m.group(2)] = float(m.group(1))
            if {"LossScaleAtFloor", "TrainingNonFinite"} <= set(seen):
                break
    finally:
        proc.terminate()
        proc.wait(30)
    text = "".join(out)
    assert f"http://127.0.0.1:{port}/metrics" in text
    assert {"LossScaleAtFloor", "TrainingNonFinite"} <= set(seen), text
    # (how fast is measured, not asserted: the demo prints the seconds since start; see bench/)
