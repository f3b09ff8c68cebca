"""docs/fleet.md's figures are bench/fleet.py's (as recorded in bench/README.md, section Fleet), and
its fleet-wide numbers are computed from them: per host series x hosts, at the scrape interval.
Its Prometheus configurations pass `promtool check config`."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _host_rows(text: str) -> dict[str, tuple[int, int]]:
    """state -> (series, /metrics bytes) from a table row '| healthy... | 180 | 21,206 B | ...'."""
    out = {}
    for m in re.finditer(r"^\| (healthy|incident)[^|]*\| ([\d,]+) \| ([\d,]+) B \|", text, re.M):
        out[m.group(1)] = (int(m.group(2).replace(",", "")), int(m.group(3).replace(",", "")))
    return out


def _num(s: str) -> float:
    s = s.replace(",", "").strip()
    return float(s[:-2]) * 1e6 if s.endswith(" M") else float(s)


def test_fleet_doc_uses_the_bench_figures() -> None:
    doc = (REPO / "docs" / "fleet.md").read_text()
    bench = (REPO / "bench" / "README.md").read_text()
    bench = bench[bench.index("## Fleet"):]
    assert _host_rows(doc) == _host_rows(bench) and set(_host_rows(doc)) == {"healthy", "incident"}
    healthy, _ = _host_rows(doc)["healthy"]
    steady = int(re.search(r"steady \*\*(\d+)\*\* series per host", doc).group(1))
    assert steady == healthy + 5    # up, scrape_duration_seconds, scrape_samples_*, scrape_series_added
    row = re.search(r"^\| active series, steady \(peak\) \| ([\d,.]+(?: M)?) \([^)]*\) \| ([\d,.]+(?: M)?) ", doc, re.M)
    assert _num(row.group(1)) == steady * 1_000 and _num(row.group(2)) == steady * 10_000
    row = re.search(r"^\| samples/s at a 30 s scrape interval \| ([\d,]+) \([^)]*\) \| ([\d,]+) ", doc, re.M)
    for hosts, got in ((1_000, row.group(1)), (10_000, row.group(2))):
        assert abs(_num(got) - steady * hosts / 30) / (steady * hosts / 30) < 0.01, (hosts, got)


def _yaml_blocks(text: str) -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)


@pytest.mark.e2e
def test_fleet_doc_prometheus_configs_pass_promtool(tmp_path: Path) -> None:
    """The file_sd scrape config, the remote_write/HA settings and the federation job of
    docs/fleet.md, put together with local stand-ins for their files, pass `promtool check config`
    (Debian's Prometheus is built without Kubernetes discovery: that block is checked by eye)."""
    from support.prom import find_binary
    blocks = [yaml.safe_load(b) for b in _yaml_blocks((REPO / "docs" / "fleet.md").read_text())]
    base = next(b for b in blocks if isinstance(b, dict) and "scrape_configs" in b)
    shard = next(b for b in blocks if isinstance(b, dict) and "remote_write" in b)
    federate = next(b[0] for b in blocks if isinstance(b, list) and b[0].get("metrics_path") == "/federate")
    for path in ("ca.crt", "pass"):
        (tmp_path / path).write_text("x\n")
    text = yaml.safe_dump(base)
    for old, new in (("/etc/prometheus/precision-agent/alerts.yml", str(REPO / "exporters/prometheus/alerts.yml")),
                     ("/etc/prometheus/precision-agent-ca.crt", str(tmp_path / "ca.crt")),
                     ("/etc/prometheus/precision-agent.pass", str(tmp_path / "pass"))):
        assert old in text, old
        text = text.replace(old, new)
    cfg = yaml.safe_load(text)
    cfg["global"].update(shard["global"])
    cfg["remote_write"] = shard["remote_write"]
    cfg["alerting"].update(shard["alerting"])
    cfg["scrape_configs"].append(federate)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([find_binary("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
