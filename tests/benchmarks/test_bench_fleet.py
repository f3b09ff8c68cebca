"""Smoke test of bench/fleet.py: it runs end to end against the real agent with tiny parameters and
writes a JSON result with sane values (no speed thresholds: figures live in bench/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is a top-level package of the repo, not installed
    sys.path.insert(0, str(ROOT))

from bench import fleet  # noqa: E402


def test_fleet_main_writes_result(tmp_path, capsys):
    assert fleet.main(["--ranks", "3", "--lines", "20", "--scrapes", "5", "--idle", "0.5",
                       "--results-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fleet.json").read_text())
    assert res["bench"] == "fleet" and res["params"]["ranks"] == 3 and res["exit_code"] == 0
    healthy, incident = res["healthy"], res["incident"]
    for m in (healthy, incident):
        assert m["series"] == sum(m["families"].values()) > 0 and m["bytes"] > 1000
        assert 0 < m["scrape_s"]["median"] <= m["scrape_s"]["p90"] <= m["scrape_s"]["max"]
        assert m["cpu_ms_per_scrape"] >= 0
        assert m["families"]["precision_agent_training_loss"] == 3   # one series per rank
    # the incident adds, per rank, its first non-finite step and time and its firing alerts
    assert incident["families"]["precision_agent_training_first_nonfinite_step"] == 3
    assert "precision_agent_training_first_nonfinite_step" not in healthy["families"]
    assert incident["alerts_firing"] >= 3 and incident["series"] > healthy["series"]
    assert "incident" in capsys.readouterr().out
