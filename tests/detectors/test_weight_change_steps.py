"""The shipped weight-change rules judged over several steps (docs/tensor-health.md, "Healthy runs
raise nothing"): MindSpore ``.npy`` dumps written here, scanned and judged by the shipped rules.

- ``WeightNotChanged``: bit-for-bit equal on 2 comparisons in a row (one skipped update is no finding);
- ``WeightChangeTooSmall``: an update ratio below 1e-7 on 3 comparisons in a row, never at a
  fine-tuning rate (a weight of size 1 moved by 1e-5 per step)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from precision_agent.dumps.scan import scan_dump
from precision_agent.dumps.watchpoints import tensor_samples
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import default_rules_dir, load_rules

rng = np.random.default_rng(7)


def _dump(root: Path, weights: list[np.ndarray]) -> list[tuple[str, int]]:
    """One MindSpore dump per step of the weight ``fc1_weight``; the findings of the shipped rules."""
    for step, w in enumerate(weights):
        d = root / "rank_0" / "Net" / "0" / str(step)
        d.mkdir(parents=True)
        ts = 1_700_000_000_000_000 + 100 * step
        np.save(d / f"Parameter.fc1_weight.{ts % 1000}.0.{ts}.output.0.DefaultFormat.npy", w.astype(np.float32))
    p = Pipeline(load_rules([default_rules_dir()]), keep_findings=100)
    return sorted((f.rule, f.step) for f in p.process(tensor_samples(scan_dump(root), {"job": "j"})))


def test_a_fine_tuning_rate_raises_nothing(tmp_path: Path) -> None:
    w = 1.0 + rng.normal(0, 0.01, size=(16, 16))      # a norm-like weight of size 1
    steps = [w]
    for _ in range(5):                                  # AdamW at 1e-5: every element moves by ~1e-5
        steps.append(steps[-1] - 1e-5 * np.sign(rng.normal(size=w.shape)))
    assert _dump(tmp_path, steps) == []


def test_one_unchanged_step_is_no_finding_two_are(tmp_path: Path) -> None:
    w = rng.normal(size=(16, 16))
    assert _dump(tmp_path / "a", [w, w, w * 1.01]) == []            # one skipped update
    assert _dump(tmp_path / "b", [w, w, w]) == [("WeightNotChanged", 2)]   # frozen / lr 0


def test_updates_at_fp32_rounding_over_three_steps(tmp_path: Path) -> None:
    w = np.ones((16, 16), np.float32)
    ulp = np.float32(np.spacing(np.float32(1.0)))
    steps = [w]
    for _ in range(4):   # every 4th element moves by one ulp: ratio ~3e-8, far below any learning rate
        nxt = steps[-1].copy()
        nxt.reshape(-1)[::4] += ulp
        steps.append(nxt)
    assert _dump(tmp_path / "three", steps[:3]) == []                   # 2 comparisons: not yet
    assert _dump(tmp_path / "four", steps) == [("WeightChangeTooSmall", 3), ("WeightChangeTooSmall", 4)]
