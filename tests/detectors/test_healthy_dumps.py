"""Every shipped rule on real msprobe dumps of healthy runs (tests/fixtures/msprobe_incidents, made
by its make.py with real msprobe and CPU torch): a small transformer block trained with AdamW at
1e-5, 1e-4 and 3e-4 (single-tensor and foreach) and with SGD, statistics and tensor tasks, the
optimizer step inside the dumped window. ``precision-agent scan`` (the daemon's samples and rules
through a fresh pipeline) must find nothing; the frozen run (AdamW at lr 0) must still raise
WeightNotChanged; and ``scan`` over a run that stays NaN reports one incident with its origin and
affected steps (docs/tensor-health.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_agent.commands.scan import scan
from precision_agent.dumps.watchpoints import DEFAULT_CLASSIFIER

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "msprobe_incidents"
HEALTHY = sorted(p for p in (FIXTURES / "healthy").glob("*") if p.is_dir()) if (FIXTURES / "healthy").is_dir() else []
pytestmark = pytest.mark.skipif(not HEALTHY, reason="fixtures not generated")


@pytest.mark.parametrize("run", HEALTHY, ids=lambda p: p.name)
def test_a_healthy_run_raises_nothing(run: Path) -> None:
    r = scan(run)
    assert r["errors"] == [] and len({t["step"] for t in r["tensors"]}) >= 3
    assert [(f["rule"], f["summary"]) for f in r["findings"]] == []


def test_the_optimizers_zero_moment_buffer_is_no_activation() -> None:
    """The issue's false TensorAllZero: Adam's exp_avg (zeros) times beta1 at step 0."""
    r = scan(FIXTURES / "healthy" / "adamw_1e-4")
    zero = [t for t in r["tensors"] if t["name"].startswith("Tensor.mul_.") and t["io"] == "output"
            and t["step"] == 0 and t["max"] == 0 and t["min"] == 0]
    assert zero, "the fixture holds the zero-initialised moment buffer"
    for t in zero:
        assert DEFAULT_CLASSIFIER.classify(f"{t['name']}:output:{t['index']}").role == "other"
    assert DEFAULT_CLASSIFIER.classify("Tensor.relu_.0.forward:output:0").role == "activation"
    assert DEFAULT_CLASSIFIER.classify("Functional.gelu.0.forward:output:0").role == "activation"


def test_a_frozen_run_still_raises_weight_not_changed() -> None:
    r = scan(FIXTURES / "frozen" / "lr0")
    rules = {f["rule"] for f in r["findings"]}
    assert rules == {"WeightNotChanged"}, r["findings"]
    f = next(f for f in r["findings"] if f["rule"] == "WeightNotChanged")
    assert f["evidence"]["steps_in_a_row"] >= 2 and f["evidence"]["offenders"] >= 6


def test_scan_over_many_steps_reports_one_incident() -> None:
    r = scan(FIXTURES / "nan_2ranks")
    (f,) = [f for f in r["findings"] if f["rule"] == "DumpNonFinite"]
    assert f["step"] == 3 and f["rank"] == 1 and f["op"].startswith("Torch.matmul."), f
    assert f["evidence"]["affected_steps"] == list(range(3, 13))
    assert f["evidence"]["affected_steps_total"] == 10 and f["evidence"]["origin_step"] == 3
