"""compare on the real msprobe corpus (../shared/corpus/msprobe): the facts of its GROUND_TRUTH.md
and ground_truth.json, and what the strict rule says that msprobe does not."""

from __future__ import annotations

import json

import pytest

from conftest import corpus_path
from precision_agent.compare.engine import compare_paths, compare_sides
from precision_agent.compare.pairing import read_side

pytestmark = pytest.mark.corpus


def _where(d):
    return None if d is None else (d["step"], d["rank"], d["op"], d["tensor"])


def _ground_truth() -> dict[tuple[str, int], dict]:
    doc = json.loads(corpus_path("msprobe", "ground_truth.json").read_text())
    return {(p["set"], p["step"]): p for p in doc["pairs"]}


def _cmp(bench: str, target: str, **kw):
    return compare_paths(str(corpus_path("msprobe", bench)), str(corpus_path("msprobe", target)), **kw)


@pytest.mark.parametrize("bench,target", [("bench", "same"), ("stats_bench", "stats_bench"),
                                          ("bench", "bench")])
def test_identical_sets(bench, target):
    res = _cmp(bench, target)
    assert res.identical and not res.diverged and not res.unmatched and len(res.rows) > 300
    assert res.first_diverging_op is None and res.first_differing_tensor is None


def test_drift_strict_names_the_fp16_linear():
    res = _cmp("bench", "drift")
    assert not res.unmatched and len(res.rows) == 326
    f = res.first_diverging_op
    assert _where(f) == (0, 0, "Functional.linear.5.forward", "output[0]")
    assert f["kind"] == "lost_precision" and f["inputs_match"] and res.corrupted_input is None
    truth = _ground_truth()[("drift", 0)]["first_diff"]
    assert f["metrics"]["MaxAbsoluteError"] == pytest.approx(truth["max_abs_err"], rel=1e-6)
    assert f["metrics"]["CosineSimilarity"] == pytest.approx(truth["cosine"], abs=1e-7)
    assert f["metrics"]["RelativeEuclideanDistance"] > f["tolerance"]
    assert _where(res.first_differing_tensor) == (0, 0, "Functional.linear.5.forward", "output[0]")


def test_drift_step1_first_differing_tensor_is_the_updated_weight():
    res = _cmp("bench", "drift", step=1)
    truth = _ground_truth()[("drift", 1)]
    assert _where(res.first_differing_tensor) == (1, 0, truth["first_diff"]["op"], "input_args[2]")
    assert sum(not r.equal for r in res.rows) == truth["n_diff_tensors"]
    # the weight moved by one ulp: within tolerance, so the fp16 linear is blamed again at step 1
    assert _where(res.first_diverging_op) == (1, 0, "Functional.linear.5.forward", "output[0]")


def test_drift_presets_pass_what_strict_catches():
    for preset in ("precision_tool", "msaccucmp", "msquickcmp"):
        res = _cmp("bench", "drift", preset=preset)
        assert res.first_diverging_op is None and not res.diverged, preset


def test_nan_strict_reports_a_corrupted_input_not_an_op():
    res = _cmp("bench", "nan")
    truth = _ground_truth()[("nan", 1)]
    assert _ground_truth()[("nan", 0)]["first_diff"] is None
    assert not any(not r.equal for r in res.rows if r.target.step == 0)
    assert _where(res.first_differing_tensor) == (1, 0, truth["first_diff"]["op"], "input_args[1]")
    assert res.first_diverging_op is None      # no op lost precision
    c = res.corrupted_input
    assert _where(c) == (1, 0, "Functional.linear.7.forward", "input_args[1]")
    assert c["kind"] == "input_differs" and not c["inputs_match"]
    assert c["metrics"]["CosineSimilarity"] == pytest.approx(truth["first_diff"]["cosine"], abs=1e-6)
    assert res.diverged
    assert sum(not r.equal for r in res.rows) == truth["n_diff_tensors"]


def test_nan_rerun_names_the_first_op_that_differs():
    res = _cmp("bench", "nan", rerun=True)
    f = res.first_diverging_op
    assert _where(f) == (1, 0, "Functional.linear.7.forward", "input_args[1]")
    assert f["kind"] == "nondeterministic" and f["target_stats"]["max"] == pytest.approx(1e20)


def test_stats_drift_and_nan():
    res = _cmp("stats_bench", "stats_drift")
    assert all(r.diff is None and r.stats_diff is not None for r in res.rows)
    assert _where(res.first_diverging_op) == (0, 0, "Functional.linear.5.forward", "output[0]")
    assert _where(res.first_differing_tensor) == (0, 0, "Functional.linear.5.forward", "output[0]")
    step1 = _cmp("stats_bench", "stats_drift", step=1)
    assert _where(step1.first_differing_tensor) == (1, 0, "Functional.layer_norm.0.forward", "input_args[2]")
    res = _cmp("stats_bench", "stats_nan")
    assert res.first_diverging_op is None
    assert _where(res.corrupted_input) == (1, 0, "Functional.linear.7.forward", "input_args[1]")
    assert _where(res.first_differing_tensor) == (1, 0, "Functional.linear.7.forward", "input_args[1]")


def test_step_dirs_pair_with_each_other():
    """Two step directories given directly (as msprobe compare takes them) pair as one group."""
    res = compare_sides(read_side(corpus_path("msprobe", "drift", "step0")),
                        read_side(corpus_path("msprobe", "bench", "step0")))
    assert len(res.rows) == 163 and not res.unmatched
    assert _where(res.first_diverging_op) == (0, 0, "Functional.linear.5.forward", "output[0]")
