"""Tensor-health watchpoints (MindInsight's conditions on dump statistics): classification of
dumped tensors, tensor_samples(), every kind on generated statistics through the real Pipeline,
and real dump trees (MindSpore npy, CANN binary, the msprobe corpus) through scan() + rules."""

from __future__ import annotations

import json
import math
import os
import textwrap
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from conftest import corpus_path
from support.dumps import ge_step_dir, write_ops
from precision_agent.config import ConfigError
from precision_agent.commands.scan import scan
from precision_agent.dumps.scanner import scan_array
from precision_agent.dumps.watchpoints import (DUMP_TENSOR, STEP_END, SKETCH_SIZE, Classifier, sketch,
                                               subject_of, tensor_samples)
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import default_rules_dir, load_rule_file, load_rules

LABELS = {"job": "train"}


# --- helpers -------------------------------------------------------------------------------------

def stats(name: str, io: str, index: int, arr, step: int | None = 0, rank: int | None = 0, **over) -> dict:
    """A scan-result tensor dict: the real scanner's statistics of ``arr``."""
    a = np.asarray(arr, dtype=np.float32)
    d = asdict(scan_array(a, name=name, io=io, index=index))
    d.update(step=step, rank=rank, path="", **over)
    return d


def stats_only(name: str, io: str, index: int, arr, **over) -> dict:
    """The same tensor as a statistics-only dump gives it (msprobe statistics mode: no
    ``abs_mean``), so the kinds must work from bounds."""
    d = stats(name, io, index, arr, **over)
    del d["abs_mean"]
    return d


def result(*tensors: dict) -> dict:
    return {"path": "/dump", "layout": "npy", "tensors": list(tensors), "first_nonfinite": None,
            "findings": [], "errors": []}


def pipeline(tmp_path: Path, kind: str, params: str = "{}") -> Pipeline:
    (tmp_path / "r.yml").write_text(textwrap.dedent(f"""
        groups:
          - name: t
            rules:
              - alert: R
                kind: {kind}
                params: {params}
                labels: {{severity: ticket}}
                annotations: {{summary: "{{{{ $labels.tensor }}}} {{{{ $value }}}}"}}
    """))
    rs = load_rules([tmp_path / "r.yml"])
    assert not rs.errors, rs.errors
    return Pipeline(rs, keep_findings=1000)


def run(p: Pipeline, *tensors: dict):
    return p.process(tensor_samples(result(*tensors), LABELS))


GRAD = "Module.fc.Linear.parameters_grad.0"
W = "Module.fc.Linear.forward.0"
rng = np.random.default_rng(7)


# --- classification ----------------------------------------------------------------------------

@pytest.mark.parametrize("subject, role, fn, bias", [
    ("Module.blocks.0.mlp.fc1.Linear.parameters_grad.0:param:1", "gradient", "", False),
    ("Functional.linear.3.backward:output:0", "gradient", "", False),
    ("Functional.linear.3.backward:input:0", "other", "", False),        # a copy of a grad output
    ("Module.blocks.0.ln1.LayerNorm.forward.0:param:0", "weight", "", False),
    ("Module.blocks.0.ln1.LayerNorm.forward.0:param:1", "weight", "", True),
    ("Functional.linear.7.forward:input:1", "weight", "", False),
    ("Functional.linear.7.forward:input:2", "weight", "", True),
    ("Functional.layer_norm.0.forward:input:3", "weight", "", True),
    ("Functional.linear.7.forward:input:0", "other", "", False),          # the previous op's output
    ("Functional.tanh.0.forward:output:0", "activation", "tanh", False),
    ("Torch.sigmoid.2.forward:output:0", "activation", "sigmoid", False),
    ("Module.act.ReLU.forward.0:output:0", "activation", "relu", False),
    ("Functional.gelu.0.forward:output:0", "activation", "", False),
    ("Functional.leaky_relu.0.forward:output:0", "activation", "", False),
    ("Relu.Default_network_relu-op12:output:0", "activation", "relu", False),
    ("MatMul.Gradients_Default_network_gradMatMul_MatMul-op40:output:0", "gradient", "", False),
    ("Parameter.fc1_weight:output:0", "weight", "", False),
    ("Parameter.fc1_bias:output:0", "weight", "", True),
    ("Module.weight_proj.Linear.forward.0:output:0", "activation", "", False),
])
def test_default_classification(subject, role, fn, bias):
    r = Classifier().classify(subject)
    assert (r.role, r.fn, r.bias) == (role, fn, bias)


def test_subject_prefixes_op_type_from_dump_file_names():
    t = {"name": "Default_relu-op3", "io": "output", "index": 0,
         "path": "/d/ReLU.Default_relu-op3.4.0.1700000000000001.output.0.DefaultFormat.npy"}
    assert subject_of(t) == "ReLU.Default_relu-op3:output:0"
    assert subject_of({"name": "Functional.relu.0.forward", "io": "output", "index": 0,
                       "path": "/d/dump.json"}) == "Functional.relu.0.forward:output:0"


# --- tensor_samples ----------------------------------------------------------------------------

def test_tensor_samples_groups_marks_and_drops_duplicates():
    w = rng.normal(size=(4, 3))
    r = result(
        stats("Functional.linear.0.forward", "input", 0, rng.normal(size=(2, 3)), step=1),
        stats("Functional.linear.0.forward", "input", 1, w, step=1),          # API copy of the weight
        stats("Functional.linear.0.forward", "output", 0, rng.normal(size=(2, 4)), step=1),
        stats(W, "param", 0, w, step=1),                                       # the module's own weight
        stats(GRAD, "param", 0, w, step=0, rank=3),
    )
    out = tensor_samples(r, LABELS)
    assert all(s.metric == DUMP_TENSOR for s in out)
    # (step 0, rank 3) first, then (step 1, rank 0); each closed by a marker
    assert all(s.step is None for s in out)       # the step is an attr: see test_no_stalled_on_dump_series
    assert [(s.attr("step"), dict(s.labels).get("rank"), s.attr("event") or s.attr("tensor")) for s in out] == [
        (0, "3", f"{GRAD}:param:0"), (0, "3", STEP_END),
        (1, "0", "Functional.linear.0.forward:output:0"), (1, "0", f"{W}:param:0"), (1, "0", STEP_END)]
    assert dict(out[0].labels) == {"job": "train", "rank": "3"}   # no tensor name in the series labels
    assert out[0].attr("role") == "gradient" and out[3].attr("role") == "weight"
    assert out[-1].attr("tensors") == 2


def test_sketch_reads_few_elements_at_fixed_positions(tmp_path):
    a = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    np.save(tmp_path / "w.npy", a)
    t = {"path": str(tmp_path / "w.npy"), "count": a.size, "dtype": "float32", "io": "output", "index": 0}
    sk = sketch(t)
    assert sk is not None and sk.size == SKETCH_SIZE and sk[0] == 0 and sk[-1] == 9999
    assert np.array_equal(sk, a.reshape(-1)[sk.astype(int)])           # values equal their positions
    assert sketch({**t, "path": str(tmp_path / "stats.json")}) is None  # statistics-only dump
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    samples = tensor_samples(result({**stats("Parameter.w", "output", 0, a), "path": str(tmp_path / "bad.npy")}),
                             LABELS)
    assert samples[0].attr("sketch") is None and "bad.npy" in samples[0].attr("sketch_error")


# --- magnitude kinds on generated statistics ---------------------------------------------------

def test_gradient_vanishing_one_finding_per_step_first_offender(tmp_path):
    p = pipeline(tmp_path, "tensor_too_small", "{abs_mean_lt: 1.0e-9}")
    tiny = rng.normal(size=64) * 1e-12
    fs = run(p, stats_only("A.backward", "output", 0, rng.normal(size=64)),
             stats_only("B.backward", "output", 0, tiny),
             stats_only("C.backward", "output", 0, tiny * 1e-3),
             stats_only("Functional.x.0.forward", "output", 0, tiny))        # an activation: not judged
    assert len(fs) == 1
    f = fs[0]
    assert dict(f.labels)["tensor"] == "B.backward:output:0" and f.step == 0
    assert f.evidence["offenders"] == 2 and f.evidence["worst_tensor"] == "C.backward:output:0"
    assert f.evidence["abs_mean_basis"] == "rms" and f.value < 1e-9
    assert f.annotations["summary"].startswith("B.backward:output:0")
    assert run(p, stats("A.backward", "output", 0, rng.normal(size=64), step=1)) == []


def test_too_large_conservative_bound_vs_rms(tmp_path):
    spiky = np.zeros(10_000)
    spiky[:2] = 1e6, -1e6                   # rms 1.4e4, mean|x| 200: heavy-tailed, not large on average
    normal = rng.normal(size=10_000) * 1e4  # mean|x| ~ 8e3 everywhere
    cons = pipeline(tmp_path, "tensor_too_large", "{abs_mean_gt: 1000}")
    fs = run(cons, stats_only("S.backward", "output", 0, spiky), stats_only("N.backward", "output", 0, normal))
    assert [dict(f.labels)["tensor"] for f in fs] == ["N.backward:output:0"]
    lo, hi = fs[0].evidence["abs_mean_range"]
    assert lo <= np.abs(normal).mean() <= hi
    loose = pipeline(tmp_path, "tensor_too_large", "{abs_mean_gt: 1000, abs_mean_estimate: rms}")
    fs = run(loose, stats_only("S.backward", "output", 0, spiky), stats_only("N.backward", "output", 0, normal))
    assert fs[0].labels and dict(fs[0].labels)["tensor"] == "S.backward:output:0" and fs[0].evidence["offenders"] == 2


def _straddling_gradient() -> tuple[np.ndarray, float, float, float]:
    """A gradient whose mean|x| lies well inside the bounds the other statistics give: mostly
    +-1e-3 with a few +-0.1 spikes. Returns (values, lower bound, mean|x|, upper bound = rms)."""
    g = np.where(rng.random(20_000) < 0.5, -1e-3, 1e-3)
    g[rng.choice(g.size, 20, replace=False)] *= 100
    g = g.astype(np.float32).astype(np.float64)
    true, rms_ = float(np.abs(g).mean()), float(np.sqrt(np.mean(g * g)))
    lower = max(abs(float(g.mean())), rms_ * rms_ / float(np.abs(g).max()))
    assert lower < 0.9 * true and 1.1 * true < rms_  # the bounds straddle every threshold below
    return g, lower, true, rms_


@pytest.mark.parametrize("kind, direction", [("tensor_too_small", "lt"), ("tensor_too_large", "gt")])
def test_scanned_gradient_judged_on_exact_abs_mean(tmp_path, kind, direction):
    # thresholds between the bounds, on both sides of the true mean|x|: from our own scan the
    # decision follows mean|x| itself (basis "exact"); from statistics only, the conservative
    # bound cannot decide and never hits
    g, lower, true, upper = _straddling_gradient()
    for thr in ((lower + true) / 2, (true + upper) / 2):
        p = pipeline(tmp_path, kind, f"{{abs_mean_{direction}: {thr!r}}}")
        scanned = stats("G.backward", "output", 0, g)
        fs = run(p, scanned)
        should = true < thr if direction == "lt" else true > thr
        assert bool(fs) == should, (kind, thr, true)
        if fs:
            ev = fs[0].evidence
            assert ev["abs_mean_basis"] == "exact" and "abs_mean_range" not in ev
            assert ev["value"] == pytest.approx(true, rel=1e-5) == scanned["abs_mean"]
        p = pipeline(tmp_path, kind, f"{{abs_mean_{direction}: {thr!r}}}")
        assert run(p, stats_only("G.backward", "output", 0, g, step=1)) == []


def test_old_scan_results_without_abs_mean_still_judged(tmp_path):
    # a scan result stored or printed before abs_mean existed (JSON, no key) and TensorStats
    # rebuilt from it: both load; the kinds fall back to bounds
    from precision_agent.model import TensorStats
    g, lower, true, upper = _straddling_gradient()
    new = stats("G.backward", "output", 0, g)
    old = json.loads(json.dumps({k: v for k, v in new.items() if k != "abs_mean"}))
    ts = TensorStats(**{**old, "shape": tuple(old["shape"])})
    assert ts.abs_mean is None and asdict(ts) == {**new, "abs_mean": None}
    p = pipeline(tmp_path, "tensor_too_large", f"{{abs_mean_gt: {lower / 2!r}}}")
    fs = run(p, old)
    assert fs and fs[0].evidence["abs_mean_basis"] == "rms"
    assert fs[0].evidence["abs_mean_range"][0] <= true <= fs[0].evidence["abs_mean_range"][1]


def test_mode_all_needs_every_threshold(tmp_path):
    g = stats("G.backward", "output", 0, rng.uniform(1, 2, size=32))   # one-signed: mean|x| exact
    assert run(pipeline(tmp_path, "tensor_too_large", "{max_gt: 1.5, mean_gt: 5}"), g)
    assert not run(pipeline(tmp_path, "tensor_too_large", "{max_gt: 1.5, mean_gt: 5, mode: all}"), g)
    fs = run(pipeline(tmp_path, "tensor_too_large", "{abs_mean_gt: 1.2}"), g)
    assert fs[0].evidence["abs_mean_basis"] == "exact"


def test_gradient_exploding_and_all_zero(tmp_path):
    bad = np.ones(8)
    bad[2] = np.nan
    bad[3] = np.inf
    p = pipeline(tmp_path, "tensor_overflow")
    fs = run(p, stats("F.forward", "output", 0, bad), stats("G.backward", "output", 0, bad))
    assert len(fs) == 1 and fs[0].evidence["nan"] == 1 and fs[0].evidence["pos_inf"] == 1
    z = pipeline(tmp_path, "tensor_all_zero")
    half = np.zeros(8)
    half[:4] = 1
    msprobe_stats = {**stats("H.backward", "output", 0, np.zeros(8)), "zero_fraction": None}
    fs = run(z, stats("Z.forward", "output", 0, np.zeros(8)), stats("Y.forward", "output", 0, half),
             msprobe_stats, stats(W, "param", 1, np.zeros(8)))       # weights are not this kind's
    assert len(fs) == 1 and fs[0].evidence["offenders"] == 2 and fs[0].value == 100.0


def test_weight_initialization_zero_not_bias_step0_only(tmp_path):
    p = pipeline(tmp_path, "weight_initialization")
    fs = run(p, stats(W, "param", 1, np.zeros(4)),                    # bias: zero is the convention
             stats(W, "param", 0, np.zeros((4, 4))))
    assert len(fs) == 1 and dict(fs[0].labels)["tensor"] == f"{W}:param:0"
    assert not run(p, stats(W, "param", 0, np.zeros((4, 4)), step=5))
    (tmp_path / "r.yml").write_text((tmp_path / "r.yml").read_text().replace("params: {}", "params: {roles: [gradient]}"))
    with pytest.raises(ConfigError, match="weights only"):
        load_rule_file(tmp_path / "r.yml")


# --- step-to-step kinds ------------------------------------------------------------------------

def _weight_file(tmp_path: Path, name: str, arr: np.ndarray, step: int) -> dict:
    path = tmp_path / f"{name}.{step}.npy"
    np.save(path, arr.astype(np.float32))
    return {**stats(f"Parameter.{name}", "output", 0, arr, step=step), "path": str(path)}


def test_weight_not_changed_on_statistics_and_sketches(tmp_path):
    w = rng.normal(size=(64, 64))
    p = pipeline(tmp_path, "weight_not_changed")
    assert run(p, stats(W, "param", 0, w, step=0)) == []                # first sighting
    fs = run(p, stats(W, "param", 0, w, step=1))
    assert fs and fs[0].evidence["basis"] == "statistics" and fs[0].evidence["previous_step"] == 0
    assert run(p, stats(W, "param", 0, w, step=1)) == []                # a rescan of the same step
    assert run(p, stats(W, "param", 0, w + 1e-3 * rng.normal(size=w.shape), step=2)) == []
    q = pipeline(tmp_path, "weight_not_changed")
    run(q, _weight_file(tmp_path, "fc1_weight", w, 0))
    fs = run(q, _weight_file(tmp_path, "fc1_weight", w, 1))
    assert fs and fs[0].evidence["basis"] == "sampled_elements" and fs[0].evidence["elements"] == SKETCH_SIZE
    w2 = w.copy()
    w2.reshape(-1)[::2] = w.reshape(-1)[1::2]     # a permutation-like change statistics cannot see
    w2.reshape(-1)[1::2] = w.reshape(-1)[::2]
    assert run(q, _weight_file(tmp_path, "fc1_weight", w2, 2)) == []


def test_weight_change_ratio_large_and_small(tmp_path):
    w = rng.normal(size=(64, 64))
    big = pipeline(tmp_path, "weight_change", "{abs_mean_update_ratio_gt: 0.1}")
    run(big, stats(W, "param", 0, w, step=0))
    fs = run(big, stats(W, "param", 0, w * 3, step=1))          # statistics only: a lower bound
    assert fs and fs[0].evidence["basis"] == "statistics_lower_bound" and 0.1 < fs[0].value <= 2.0 * 1.01
    small = pipeline(tmp_path, "weight_change", "{abs_mean_update_ratio_lt: 1.0e-4}")
    run(small, stats(W, "param", 0, w, step=0))
    assert run(small, stats(W, "param", 0, w + 1e-7, step=1)) == []    # stats cannot prove "small"
    run(small, _weight_file(tmp_path, "fc2_weight", w, 0))
    fs = run(small, _weight_file(tmp_path, "fc2_weight", w + 1e-7 * rng.normal(size=w.shape), 1))
    assert fs and fs[0].evidence["basis"] == "sampled_elements" and fs[0].value < 1e-4
    assert run(small, _weight_file(tmp_path, "fc2_weight", w * 1.01, 2)) == []
    # one huge element the sketch does not sample: the statistics bound still catches it
    big2 = pipeline(tmp_path, "weight_change", "{abs_mean_update_ratio_gt: 1}")
    run(big2, _weight_file(tmp_path, "fc3_weight", w, 0))
    w3 = w.copy()
    w3[0, 1] = 1e20
    fs = run(big2, _weight_file(tmp_path, "fc3_weight", w3, 1))
    assert fs and fs[0].evidence["basis"] == "statistics_lower_bound"


def test_change_memory_is_capped(tmp_path):
    p = pipeline(tmp_path, "weight_not_changed", "{max_tensors: 2}")
    ws = [stats(f"Module.l{i}.Linear.forward.0", "param", 0, rng.normal(size=8)) for i in range(3)]
    run(p, *ws)
    rule = p.rules.rules[0]
    assert len(rule.detector._prev) == 2
    fs = run(p, *[{**w, "step": 1} for w in ws[1:]])
    assert fs[0].evidence["offenders"] == 2
    assert run(p, {**ws[0], "step": 2}) == []    # the first weight was forgotten: nothing to compare


# --- activation saturation ---------------------------------------------------------------------

def test_activation_saturation_from_statistics(tmp_path):
    p = pipeline(tmp_path, "activation_range")
    x = rng.normal(size=4096)
    fs = run(p, stats("Functional.tanh.0.forward", "output", 0, np.tanh(x)),          # healthy
             stats("Functional.tanh.1.forward", "output", 0, np.tanh(x * 100 + np.sign(x) * 10)),
             stats("Torch.sigmoid.0.forward", "output", 0, 1 / (1 + np.exp(-(x * 100 + np.sign(x) * 20)))),
             stats("Functional.relu.0.forward", "output", 0, np.maximum(x, 0)),       # half zero: fine
             stats("Functional.gelu.0.forward", "output", 0, np.zeros(4096)))       # not a watched fn
    assert len(fs) == 1 and dict(fs[0].labels)["tensor"] == "Functional.tanh.1.forward:output:0"
    assert fs[0].evidence["offenders"] == 2 and fs[0].evidence["function"] == "tanh"
    dead = np.zeros(10_000)
    dead[:5] = 1.0                                                                 # 99.95 % zeros
    fs = run(p, stats("Functional.relu.1.forward", "output", 0, dead, step=1))
    assert fs and fs[0].evidence["condition"] == "dead" and fs[0].value >= 99.9


# --- rule-file parameters ----------------------------------------------------------------------

def test_patterns_overridable_and_validated(tmp_path):
    p = pipeline(tmp_path, "tensor_all_zero", "{activation_patterns: ['^Special[.]'], exclude: ['skip']}")
    fs = run(p, stats("Functional.a.0.forward", "output", 0, np.zeros(4)),
             stats("Special.skip.0", "output", 0, np.zeros(4)),
             stats("Special.keep.0", "output", 0, np.zeros(4)))
    assert [dict(f.labels)["tensor"] for f in fs] == ["Special.keep.0:output:0"]
    for params, word in [("{exclude: ['(']}", "exclude"), ("{}", "abs_mean_lt"),
                         ("{exclude: ['(?<!leaky)relu'], abs_mean_lt: 1}", "lookahead and lookbehind are not supported"),
                         ("{abs_mean_lt: 1, max_gt: 2}", "max_gt"), ("{abs_mean_lt: -1}", "abs_mean_lt")]:
        (tmp_path / "bad.yml").write_text(textwrap.dedent(f"""
            groups:
              - name: t
                rules:
                  - alert: Bad
                    kind: tensor_too_small
                    params: {params}
                    labels: {{severity: ticket}}
        """))
        with pytest.raises(ConfigError) as err:
            load_rule_file(tmp_path / "bad.yml")
        assert word in str(err.value)


def test_user_patterns_are_linear_on_hostile_tensor_names():
    """A rule file's classification lists run on RE2: ``(a+)+b`` on a tensor named with a long run
    of ``a`` answers at once (hours on a backtracking engine); the shipped defaults, which need
    lookaround, still classify."""
    c = Classifier(exclude=["(a+)+b"], activation=["(x+x+)+y"])
    assert c.classify("a" * 5000 + ":output:0").role == "other"
    assert c.classify("x" * 5000 + "y:output:0").role == "activation"
    assert Classifier().classify("Functional.leaky_relu.0.forward:output:0").fn == ""


# --- real dumps through scan() + tensor_samples() + the shipped rules --------------------------

def shipped() -> Pipeline:
    rs = load_rules([default_rules_dir()])
    assert not rs.errors
    assert {"GradientVanishing", "WeightNotChanged", "ActivationSaturation"} <= {r.name for r in rs.rules}
    return Pipeline(rs, keep_findings=1000)


def _ms_npy(d: Path, op_type: str, op: str, ts: int, arr: np.ndarray) -> None:
    d.mkdir(parents=True, exist_ok=True)
    np.save(d / f"{op_type}.{op}.{ts % 1000}.0.{ts}.output.0.DefaultFormat.npy", arr.astype(np.float32))


def test_mindspore_npy_dump_end_to_end(tmp_path):
    x = rng.normal(size=(32, 16))
    w = rng.normal(size=(16, 16))
    for step in (0, 1, 2):   # WeightNotChanged asks for two unchanged comparisons in a row
        d = tmp_path / "rank_0" / "Net" / "0" / str(step)
        ts = 1_700_000_000_000_000 + 100 * step
        _ms_npy(d, "Parameter", "fc1_weight", ts, np.zeros((16, 16)) if step == 0 else w * (1 + 0.01 * step))
        _ms_npy(d, "Parameter", "fc2_weight", ts + 1, w)                      # never updated
        _ms_npy(d, "Tanh", "Default_net_Tanh-op3", ts + 2, np.tanh(x * 50 + np.sign(x) * 12))
        _ms_npy(d, "ReLU", "Default_net_ReLU-op4", ts + 3, np.maximum(x, 0))
        _ms_npy(d, "MatMul", "Gradients_Default_net_gradMatMul_MatMul-op9", ts + 4, x * 1e-13)
    r = scan(tmp_path)
    assert r["layout"] == "mindspore" and not r["errors"]
    fs = shipped().process(tensor_samples(r, LABELS))
    got = {(f.rule, f.step, dict(f.labels)["tensor"]) for f in fs}
    assert got == {
        ("WeightInitAllZero", 0, "Parameter.fc1_weight:output:0"),
        ("ActivationSaturation", 0, "Tanh.Default_net_Tanh-op3:output:0"),
        ("ActivationSaturation", 1, "Tanh.Default_net_Tanh-op3:output:0"),
        ("ActivationSaturation", 2, "Tanh.Default_net_Tanh-op3:output:0"),
        ("GradientVanishing", 0, "MatMul.Gradients_Default_net_gradMatMul_MatMul-op9:output:0"),
        ("GradientVanishing", 1, "MatMul.Gradients_Default_net_gradMatMul_MatMul-op9:output:0"),
        ("GradientVanishing", 2, "MatMul.Gradients_Default_net_gradMatMul_MatMul-op9:output:0"),
        ("WeightNotChanged", 2, "Parameter.fc2_weight:output:0"),
        ("WeightChangeTooLarge", 1, "Parameter.fc1_weight:output:0"),          # from all zeros
    }
    assert all(f.severity == "ticket" for f in fs)
    wnc = next(f for f in fs if f.rule == "WeightNotChanged")
    assert wnc.evidence["basis"] == "sampled_elements" and dict(wnc.labels)["rank"] == "0"


def test_no_stalled_on_dump_series(tmp_path):
    """A dump series has no training progress: an hour after a scan, step-based kinds
    (TrainingStalled) must not call it a hung job."""
    d = tmp_path / "rank_0" / "Net" / "0" / "3"
    _ms_npy(d, "Parameter", "fc1_weight", 1_700_000_000_000_000, rng.normal(size=(4, 4)))
    p = shipped()
    samples = tensor_samples(scan(tmp_path), LABELS)
    p.process(samples)
    for dt in (0, 700, 3600):
        p.tick(samples[0].time + dt)
    assert [a for a in p.alerts.alerts.values()] == []


def test_cann_dump_sketch_and_gradients(tmp_path):
    w = rng.normal(size=(8, 8)).astype(np.float32)
    for step in (0, 1, 2):
        d = ge_step_dir(str(tmp_path), 0, step)
        write_ops(d, [("VariableV2", "dense_kernel", 1, [], [w]),
                      ("Sigmoid", "dense_Sigmoid", 2, [w], [np.full((8, 8), 1.0, np.float32)])],
                  1_700_000_000_000_000 + 10 * step)
    r = scan(tmp_path)
    assert r["layout"] == "cann"
    samples = tensor_samples(r, LABELS)
    kernel = [s for s in samples if s.attr("tensor") == "VariableV2.dense_kernel:output:0"]
    assert len(kernel) == 3 and all(s.attr("role") == "weight" for s in kernel)
    assert np.array_equal(kernel[0].attr("sketch"), w.reshape(-1).astype(np.float64))
    fs = shipped().process(samples)
    assert sorted((f.rule, f.step) for f in fs) == [("ActivationSaturation", 0), ("ActivationSaturation", 1),
                                                     ("ActivationSaturation", 2), ("WeightNotChanged", 2)]
    assert next(f for f in fs if f.rule == "WeightNotChanged").evidence["basis"] == "sampled_elements"


@pytest.mark.parametrize("name, expected", [
    ("stats_bench", set()), ("bench", set()), ("same", set()), ("drift", set()), ("stats_drift", set()),
    ("nan", {"GradientTooLarge", "GradientExploding", "WeightChangeTooLarge"}),
    ("stats_nan", {"GradientTooLarge", "GradientExploding", "WeightChangeTooLarge"}),
])
def test_msprobe_corpus(name, expected):
    r = scan(corpus_path("msprobe", name))
    fs = shipped().process(tensor_samples(r, LABELS))
    health = [f for f in fs if f.kind in ("tensor_too_large", "tensor_overflow", "weight_change",
                                          "weight_not_changed", "tensor_too_small", "tensor_all_zero",
                                          "activation_range", "weight_initialization")]
    assert {f.rule for f in health} == expected
    change = [f for f in health if f.rule == "WeightChangeTooLarge"]
    for f in change:   # the planted fault: one blocks.1.mlp.fc2 weight element set to 1e20 before step 1
        assert f.step == 1 and f.evidence["offenders"] == 1
        assert dict(f.labels)["tensor"] in ("Functional.linear.7.forward:input:1",
                                           "Module.blocks.1.mlp.fc2.Linear.forward.0:param:0")
    assert all(len(dict(f.labels)) <= 4 for f in health)   # job, rank, tensor, severity
