"""Smoke test of bench/: each bench's main() runs end to end against the real agent with tiny
parameters and writes a JSON result with the expected shape and sane values.

No speed thresholds here on purpose: speed is measured and reported by ``python -m bench``
(see bench/README.md), never asserted in tests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is a top-level package of the repo, not installed
    sys.path.insert(0, str(ROOT))

from bench import common, compare, fuzz, idle, latency, parse, scan  # noqa: E402
from bench import scantree  # noqa: E402

if not Path("/proc/self/stat").exists():  # pragma: no cover - the agent targets Linux hosts
    pytest.skip("the benches read /proc", allow_module_level=True)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_latency_main_writes_result(tmp_path, capsys):
    n = 3
    assert latency.main(["--n", str(n), "--poll-ms", "5", "--poll-ms", "20", "--push-n", "2",
                         "--results-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "latency.json").read_text())
    assert res["bench"] == "latency"
    for key in ("date", "host", "agent_config", "params", "goal", "startup_s", "runs", "summary"):
        assert key in res
    assert res["params"]["n"] == n
    assert [r["poll_interval_s"] for r in res["runs"]] == [0.005, 0.02]
    for r in res["runs"]:
        assert r["n"] == n and len(r["samples_s"]) == n and len(r["lower_bounds_s"]) == n
        assert r["timeouts"] == 0
        assert all(_positive(v) for v in r["samples_s"])
        assert all(0 <= lo <= v for lo, v in zip(r["lower_bounds_s"], r["samples_s"]))
        assert r["min_s"] <= r["median_s"] <= r["p90_s"] <= r["p99_s"] <= r["max_s"]
        assert r["ratio_median_to_goal"] == pytest.approx(r["median_s"] / res["goal"]["median_s"])
        assert r["scrapes"] >= n
        assert r["agent_cpu_percent"] >= 0
    assert res["summary"]["median_s"] == res["runs"][0]["median_s"]
    push = res["push"]  # a new alert per event: on the agent's API, then at a real Alertmanager's webhook
    assert push["n"] == 2 and push["api"]["timeouts"] == 0 and all(_positive(v) for v in push["api"]["samples_s"])
    if push["alertmanager"] is None:  # not installed: said so, never faked
        assert "webhook" not in push and push["alertmanager_unavailable"]
    else:
        w = push["webhook"]
        assert w["timeouts"] == 0 and w["posts"] >= 2
        assert all(_positive(v) for v in w["samples_s"])
    assert res["agent_config"]["debounce_s"] > 0
    assert res["exit_code"] == 0  # SIGTERM: a clean stop
    assert "median" in capsys.readouterr().out


def test_idle_main_writes_result(tmp_path, capsys):
    assert idle.main(["--files", "3", "--lines", "5", "--duration", "1.5", "--scrape-interval", "0.5",
                      "--scrape-duration", "1", "--scrape-burst", "5", "--results-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "idle.json").read_text())
    assert res["bench"] == "idle"
    for key in ("date", "host", "params", "goal", "startup_s", "idle", "scraping", "ratios", "meets_goal"):
        assert key in res
    assert res["lines_read"] == 3 * 5
    i = res["idle"]
    assert i["duration_s"] >= 1.5 and i["cpu_seconds"] >= 0 and i["cpu_percent_of_core"] >= 0
    assert 1 < i["rss_mb"] <= i["hwm_mb"] < 10_000
    assert i["threads"] >= 1
    assert len(i["samples"]) >= 2
    s = res["scraping"]
    assert s["scrapes"] >= 2 and s["metrics_bytes"] > 0
    assert res["scrape_burst"]["scrapes"] == 5 and res["scrape_burst"]["cpu_ms_per_scrape"] >= 0
    assert res["ratios"]["rss"] == pytest.approx(i["rss_mb"] / res["goal"]["rss_mb"])
    assert res["exit_code"] == 0
    assert "RSS" in capsys.readouterr().out


def test_cli_help_and_choices():
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--quick" in out.stdout and "--only" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "bench", "--only", "nope"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2


def test_helpers():
    assert common.percentile([5, 1, 4, 2, 3], 50) == 3
    assert common.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == 9
    assert common.percentile(range(1, 101), 90) == 90
    text = ('# HELP x y\nprecision_agent_training_step{rank="0"} 12.0\n'
            'precision_agent_training_step_other 3\nprecision_agent_training_step 7.0\n')
    assert common.metric_values(text, "precision_agent_training_step") == [12.0, 7.0]
    line = common.megatron_line(42)
    assert line.endswith("|\n") and "iteration       42/  100000 |" in line


def test_parse_bench_reports_same_run_ratios():
    res = parse.run(lines=2000, repeat=1)
    assert res["params"]["lines"] == 2000 and res["samples"] > 0
    assert res["plain_loop_s"] > 0 and res["parse_s"] > 0 and res["pipeline_s"] > 0
    assert res["ratios"]["parse_to_plain"] == res["parse_s"] / res["plain_loop_s"]
    assert "lines/s" in parse.report(res)
    assert res["custom_samples"] == res["samples"] > 0   # the user's pattern reads what the parser reads


def test_scan_bench_reports_same_run_ratios():
    res = scan.run(size_mib=8, file_mib=16, repeat=1)
    assert res["sum_s"] > 0 and res["scan_f32_s"] > 0 and res["peak_rss_mb"] > 0
    assert abs(res["ratios"]["f32_to_sum"] - res["sum_s"] / res["scan_f32_s"]) < 1e-12
    assert "ratio" in scan.report(res) or "goal" in scan.report(res)
    # the real command against numpy's mmap sum of the same cached file, both net of start-up
    row = res["cli_vs_numpy"]
    assert row["ratio"] == row["net_s"]["numpy"] / row["net_s"]["agent"]
    assert set(row["net_s"]) == {"agent", "agent_map", "numpy"} and row["peak_rss_mb"]["agent"] > 0
    assert "numpy mmap sum" in scan.report(res)


def test_scan_bench_cli_only_row(tmp_path):
    assert scan.main(["--cli-only", "--file-mib", "8", "--repeat", "1", "--results-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "scan.json").read_text())
    assert res["params"]["cli_only"] and res["cli_vs_numpy"]["file_bytes"] > 8 << 20


def test_compare_main_writes_result(tmp_path):
    assert compare.main(["--size-mib", "1", "--repeat", "1", "--results-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "compare.json").read_text())
    assert res["bench"] == "compare" and all(_positive(v) for v in res["ratios"].values())


def test_fuzz_bench_counts_cases_and_failures(tmp_path):
    assert fuzz.main(["--seed", "5", "--scale", "0.02", "--text-max", "4096", "--target", "log_lines",
                      "--target", "protobuf", "--target", "config", "--target", "http",
                      "--results-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fuzz.json").read_text())
    assert res["bench"] == "fuzz" and res["params"]["targets"] == ["log_lines", "protobuf", "config", "http"]
    assert res["cases"] == sum(r["cases"] for r in res["targets"].values()) > 0
    assert res["failures"] == 0 and res["cases_per_s"] > 0


def test_scantree_quick_writes_result(tmp_path, capsys):
    assert scantree.main(["--quick", "--jobs", "2", "--results-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "scantree.json").read_text())
    assert res["bench"] == "scantree" and res["params"]["jobs"] == 2
    assert res["params"]["bytes"] == 2 * 2 * 2 * (1 << 20)
    assert all(math.isfinite(v) and v > 0 for v in res["wall_s"].values())
    r, w = res["ratios"], res["wall_s"]
    assert r["jobsN_to_numpy"] == pytest.approx(w["numpy_procs"] / w["cli_jobsN"])
    # the command scanned every file, found the NaN the tree holds, and said the same for any N
    assert res["output_same_for_jobs1_and_N"] is True
    assert res["tensors"] == 4 and res["errors"] == 0 and res["exit_status"] == 1
    assert "numpy processes" in capsys.readouterr().out
