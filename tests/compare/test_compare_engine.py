"""compare engine and verdicts on generated dumps: the strict rule against the presets, corrupted
inputs, backward ops and their saved tensors, nondeterminism, statistics dumps, unreadable and
mismatched tensors, dtype tolerances, and the CSV layouts."""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import pytest

from precision_agent.compare.engine import compare_paths
from precision_agent.compare.report import (MSACCUCMP_HEADER, MSPROBE_STATS_HEADER, to_json, verdict,
                                            write_csv)
from precision_agent.compare.verdict import tolerance
from support.dumps import RNG, W2, X
from support.dumps import tiny_net as _net


def _where(d):
    return None if d is None else (d["op"], d["tensor"])


def test_strict_names_a_half_precision_linear_that_the_presets_pass(tmp_path):
    _net(tmp_path / "bench")
    _net(tmp_path / "target", half_fc2=True)
    res = compare_paths(tmp_path / "bench", tmp_path / "target")
    assert _where(res.first_diverging_op) == ("Functional.linear.1.forward", "output[0]")
    assert res.first_diverging_op["kind"] == "lost_precision" and verdict(res) == "lost_precision"
    assert _where(res.first_differing_tensor) == ("Functional.linear.1.forward", "output[0]")
    cos = res.first_diverging_op["metrics"]["CosineSimilarity"]
    assert cos > 0.9999          # every peer threshold passes it
    for preset in ("precision_tool", "msaccucmp", "msquickcmp"):
        assert not compare_paths(tmp_path / "bench", tmp_path / "target", preset=preset).diverged, preset


def test_corrupted_weight_is_an_input_not_an_op(tmp_path):
    w2 = W2.copy()
    w2[3, 5] = 1e20
    _net(tmp_path / "bench")
    _net(tmp_path / "target", w2=w2)
    res = compare_paths(tmp_path / "bench", tmp_path / "target")
    assert res.first_diverging_op is None and verdict(res) == "input_differs"
    assert _where(res.corrupted_input) == ("Functional.linear.1.forward", "input_args[1]")
    doc = to_json(res)
    assert "no op lost precision" in doc["summary"] and "input_args[1]" in doc["summary"]
    # tanh.backward's own input (the seed grad) matches, but its forward saved a differing output:
    # it must not be blamed for losing precision
    back = [r for r in res.rows if r.target.name == "Torch.tanh.0.backward"]
    assert back[0].ok is True and back[1].ok is False


def test_rerun_mode_names_the_first_op_with_a_different_bit(tmp_path):
    _net(tmp_path / "run1")
    _net(tmp_path / "run2", bump=5)
    strict = compare_paths(tmp_path / "run1", tmp_path / "run2")
    assert not strict.diverged and verdict(strict) == "within_tolerance"     # one ulp: tolerated
    res = compare_paths(tmp_path / "run1", tmp_path / "run2", rerun=True)
    assert res.diverged and verdict(res) == "nondeterministic"
    f = res.first_diverging_op
    assert _where(f) == ("Torch.tanh.0.forward", "output[0]") and f["kind"] == "nondeterministic"
    assert f["differ"] == 1 and f["first_diff_index"] == 5
    assert set(f["target_stats"]) >= {"max", "min", "mean", "l2norm"}
    same = compare_paths(tmp_path / "run1", tmp_path / "run1", rerun=True)
    assert same.identical and not same.diverged


def test_statistics_dumps(tmp_path):
    _net(tmp_path / "bench", task="statistics")
    _net(tmp_path / "target", task="statistics", half_fc2=True)
    res = compare_paths(tmp_path / "bench", tmp_path / "target")
    assert all(r.diff is None and r.stats_diff is not None for r in res.rows)
    assert _where(res.first_diverging_op) == ("Functional.linear.1.forward", "output[0]")
    out = io.StringIO()
    write_csv(res, out, "msprobe")
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert rows[0] == MSPROBE_STATS_HEADER
    by_name = {r[0]: r for r in rows[1:]}
    assert by_name["Functional.linear.1.forward.output.0"][-2] == "error"
    assert by_name["Torch.relu.0.forward.input.0"][-2] == "pass"
    assert by_name["Torch.relu.0.forward.input.0"][10].endswith("%")


def test_unreadable_and_mismatched_tensors_are_rows_with_reasons(tmp_path):
    _net(tmp_path / "bench")
    d = _net(tmp_path / "target")
    (d / "dump_tensor_data" / "Torch.relu.0.forward.output.0.npy").write_bytes(b"\x93NUMPY garbage")
    np.save(d / "dump_tensor_data" / "Torch.relu.0.forward.input.0.npy", np.zeros((8, 31), np.float32))
    res = compare_paths(tmp_path / "bench", tmp_path / "target")
    rows = {(r.target.name, r.target.io, r.target.index): r for r in res.rows}
    for key in (("Torch.relu.0.forward", "output", 0), ("Torch.relu.0.forward", "input", 0)):
        assert rows[key].ok is None and "cannot compare" in rows[key].fail_reason
    assert "dump.json shape" in rows[("Torch.relu.0.forward", "input", 0)].fail_reason
    assert sum(e["side"] == "pair" and "relu" in e["path"] for e in res.errors) == 2
    assert rows[("Functional.linear.1.forward", "output", 0)].ok is True   # the rest still compared
    assert res.first_diverging_op is None and not res.diverged              # no evidence is not a verdict


def test_shape_mismatch_and_flat_comparison(tmp_path):
    for side in ("bench", "target"):
        (tmp_path / side).mkdir()
    np.save(tmp_path / "bench" / "a.npy", X)
    np.save(tmp_path / "target" / "a.npy", X[:, :15].copy())
    np.save(tmp_path / "bench" / "b.npy", X)
    np.save(tmp_path / "target" / "b.npy", X.reshape(-1))
    res = compare_paths(tmp_path / "bench", tmp_path / "target")
    rows = {r.target.name: r for r in res.rows}
    assert rows["a.npy"].ok is False and "shape mismatch" in rows["a.npy"].fail_reason
    assert rows["b.npy"].ok is True and rows["b.npy"].equal and "flattened" in rows["b.npy"].fail_reason


def test_tolerances_by_dtype():
    assert tolerance("float32", "float32") == 2.0 ** -14
    assert tolerance("float16", "float32") == 2.0 ** -9       # the coarser dtype decides
    assert tolerance("bfloat16", "bfloat16") == 2.0 ** -6
    assert tolerance("float64", "float64") == 2.0 ** -43
    assert tolerance("int32", "int32") == 0.0 and tolerance("bool", "bool") == 0.0
    # the fp16 rounding of an fp32 result lands above the fp32 tolerance, a reordered sum below
    a = RNG.standard_normal(4096).astype(np.float32)
    rounded = a.astype(np.float16).astype(np.float32)
    red = np.linalg.norm((rounded - a).astype(np.float64)) / np.linalg.norm(a.astype(np.float64))
    assert red > 2 * tolerance("float32", "float32")
    terms = RNG.standard_normal((64, 1024)).astype(np.float32)
    fwd = terms.sum(axis=1, dtype=np.float32)
    rev = terms[:, ::-1].cumsum(axis=1, dtype=np.float32)[:, -1]
    red = np.linalg.norm((fwd - rev).astype(np.float64)) / np.linalg.norm(fwd.astype(np.float64))
    assert 0 < red < tolerance("float32", "float32") / 10


def test_bf16_and_integer_tensors_in_npy_trees(tmp_path):
    for side in ("bench", "target"):
        (tmp_path / side).mkdir()
    ids = np.arange(10, dtype=np.int64)
    np.save(tmp_path / "bench" / "ids.npy", ids)
    ids2 = ids.copy()
    ids2[9] = 11
    np.save(tmp_path / "target" / "ids.npy", ids2)
    np.save(tmp_path / "bench" / "act.npy", X)
    np.save(tmp_path / "target" / "act.npy", X * np.float32(1 + 2 ** -20))
    res = compare_paths(tmp_path / "bench", tmp_path / "target")
    rows = {r.target.name: r for r in res.rows}
    assert rows["ids.npy"].ok is False and rows["act.npy"].ok is True
    assert _where(res.first_diverging_op) == ("ids.npy", "output[0]")


def test_msaccucmp_csv_layout(tmp_path):
    _net(tmp_path / "bench")
    _net(tmp_path / "target", half_fc2=True, step=0)
    _net(tmp_path / "target", step=1)      # a step the bench lacks: unmatched rows with '*'
    res = compare_paths(tmp_path / "bench", tmp_path / "target")
    out = io.StringIO()
    write_csv(res, out)
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert rows[0] == MSACCUCMP_HEADER and rows[0].count("DataType") == 2
    assert len(rows) == 1 + len(res.rows) + len(res.unmatched)
    row = next(r for r in rows[1:] if r[8] == "Functional.linear.1.forward:output:0")
    assert row[2] == row[5] == "Functional.linear.1.forward" and row[3] == "float32" and row[4] == "NaN"
    cos = row[MSACCUCMP_HEADER.index("CosineSimilarity")]
    assert cos.count(".") == 1 and len(cos.split(".")[1]) == 6 and float(cos) > 0.999
    assert row[MSACCUCMP_HEADER.index("StandardDeviation")].startswith("(")
    orphans = [r for r in rows[1:] if r[5] == "*"]
    assert len(orphans) == len(res.unmatched) and all(r[10] == "NaN" for r in orphans)
    with pytest.raises(ValueError):
        write_csv(res, io.StringIO(), "excel")


def test_json_is_complete_and_finite(tmp_path):
    _net(tmp_path / "bench")
    _net(tmp_path / "target", half_fc2=True)
    doc = to_json(compare_paths(tmp_path / "bench", tmp_path / "target"))
    assert {"pairs", "unmatched", "first_diverging_op", "first_differing_tensor", "identical",
            "rows"} <= set(doc)
    assert doc["pairs"] == len(doc["rows"]) == 12 and doc["identical"] is False
    assert set(doc["first_diverging_op"]) >= {"step", "rank", "op", "tensor", "metrics"}
    assert all(not isinstance(v, float) or math.isfinite(v) or math.isnan(v)
               for r in doc["rows"] for v in r.get("metrics", {}).values())


def test_cli_json_writer_is_json_with_one_row_per_line(tmp_path):
    """--json goes through json's C encoder one value at a time: the same document as
    json.dumps, with each row on its own line (grep-able, diff-able)."""
    import json

    from precision_agent.commands.compare import write_json
    from precision_agent.model import json_safe
    _net(tmp_path / "bench")
    _net(tmp_path / "target", half_fc2=True)
    doc = json_safe(to_json(compare_paths(tmp_path / "bench", tmp_path / "target")))
    buf = io.StringIO()
    write_json(doc, buf)
    text = buf.getvalue()
    assert json.loads(text) == json.loads(json.dumps(doc)) and text.endswith("}\n")
    row_lines = [ln for ln in text.splitlines() if ln.startswith("    {")]
    assert len(row_lines) == len(doc["rows"]) == 12
    assert all(json.loads(ln.strip().rstrip(",")) in doc["rows"] for ln in row_lines)
    empty = io.StringIO()
    write_json({"rows": [], "unmatched": [], "x": None}, empty)
    assert json.loads(empty.getvalue()) == {"rows": [], "unmatched": [], "x": None}


def test_hostile_tensors_become_rows_not_crashes(tmp_path):
    for side in ("bench", "target"):
        (tmp_path / side).mkdir()
        np.save(tmp_path / side / "rec.npy", np.zeros(3, dtype=[("a", "<f4"), ("b", "<i2")]))
        np.save(tmp_path / side / "ok.npy", X)
    np.save(tmp_path / "target" / "cplx.npy", np.ones(4, np.complex64))
    np.save(tmp_path / "bench" / "cplx.npy", np.full(4, 1j, np.complex64))
    res = compare_paths(tmp_path / "bench", tmp_path / "target")
    rows = {r.target.name: r for r in res.rows}
    assert rows["ok.npy"].ok is True and len(rows) == 3
    # no metrics for these dtypes: equal bytes are equal; different bytes cannot be judged
    assert rows["rec.npy"].equal and rows["rec.npy"].ok is True
    assert rows["cplx.npy"].ok is None and "cannot compare" in rows["cplx.npy"].fail_reason
    assert not res.diverged and any("cplx" in e["path"] for e in res.errors)
    rerun = {r.target.name: r for r in compare_paths(tmp_path / "bench", tmp_path / "target", rerun=True).rows}
    assert rerun["cplx.npy"].ok is False and rerun["rec.npy"].ok is True


def test_many_steps_are_one_incident_from_the_lowest_diverging_step(tmp_path):
    """``compare`` over many steps reports the incident as the daemon alerts it: origin and affected steps."""
    for step in (0, 1, 2, 3):
        _net(tmp_path / "bench", step=step)
        _net(tmp_path / "target", step=step, half_fc2=step >= 2)
    doc = to_json(compare_paths(tmp_path / "bench", tmp_path / "target"))
    inc = doc["incident"]
    assert (inc["origin_step"], inc["op"]) == (2, "Functional.linear.1.forward"), inc
    assert inc["affected_steps"] == [2, 3] and inc["affected_steps_total"] == 2
    _net(tmp_path / "same", step=0)
    assert to_json(compare_paths(tmp_path / "bench", tmp_path / "same", step=0))["incident"] is None
