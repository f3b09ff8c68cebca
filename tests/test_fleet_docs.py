"""docs/fleet.md's figures are bench/fleet.py's (as recorded in bench/README.md, section Fleet), and
its fleet-wide numbers are computed from them: per host series x hosts, at the scrape interval."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
