"""Dump readers: npy/npz, torch.save zips without torch, msprobe dump dirs, MindSpore names.

Synthetic fixtures (written here, same layout as the corpus .pt files) run everywhere; the
corpus tests check every msprobe set against ground_truth.json and skip without ../shared.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import corpus_path
from precision_agent.dumps.mindspore import parse_npy_name, read_mindspore_npy_dir, read_statistic_csv
from precision_agent.dumps.msprobe import list_msprobe_dump, read_msprobe_rank_dir
from precision_agent.dumps.npy import read_npy, read_npz
from precision_agent.dumps.torchzip import open_pt, open_pt_raw, read_pt
from precision_agent.dumps.types import DumpError, DumpTensor
from support.torchpt import _u, tensor_pickle, write_pt, write_pt_raw
from support.torchpt import write_msprobe_pt as write_msprobe

# ----------------------------------------------------------------------------- writers


# ----------------------------------------------------------------------------- helpers

def nonfinite_counts(arr: np.ndarray) -> tuple[int, int, int]:
    a = np.asarray(arr)
    if a.dtype.kind not in "fc":
        return 0, 0, 0
    return int(np.isnan(a).sum()), int(np.isposinf(a).sum()), int(np.isneginf(a).sum())


def is_nonfinite(t: DumpTensor) -> bool:
    if t.load is not None:
        return sum(nonfinite_counts(t.load())) > 0
    return t.stats is not None and t.stats.nonfinite > 0


def first_nonfinite(tensors: list[DumpTensor]) -> DumpTensor | None:
    """First output, in execution order, that is non-finite while all inputs of its call are finite."""
    by_entry: dict[tuple, list[DumpTensor]] = {}
    for t in tensors:
        by_entry.setdefault((t.step, t.rank, t.order), []).append(t)
    for group in by_entry.values():
        if any(is_nonfinite(t) for t in group if t.io == "input"):
            continue
        for t in group:
            if t.io == "output" and is_nonfinite(t):
                return t
    return None


# ----------------------------------------------------------------------------- synthetic: .pt

def test_pt_roundtrip_dtypes_and_views(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 5
    t = read_pt(write_pt(tmp_path / "a.pt", a))
    assert (t.name, t.dtype, t.shape) == ("a", "float32", (2, 3, 4))
    got = t.load()
    np.testing.assert_array_equal(got, a)
    assert not got.flags.writeable
    m = np.arange(12, dtype=np.float64).reshape(3, 4)
    np.testing.assert_array_equal(read_pt(write_pt(tmp_path / "t.pt", m, transpose=True)).load(), m)
    words = np.array([0x3F80, 0x7F80, 0xFFC0], dtype=np.uint16)  # 1.0, +inf, nan in bf16
    tb = read_pt(write_pt(tmp_path / "b.pt", words, dtype="bfloat16"))
    assert tb.dtype == "bfloat16" and tb.load().dtype == np.uint16
    np.testing.assert_array_equal(tb.load(), words)
    s = read_pt(write_pt(tmp_path / "s.pt", np.array(np.inf, dtype=np.float32)))
    assert s.shape == () and math.isinf(float(s.load()))
    i64 = np.array([[1, -2], [3, 4]], dtype=np.int64)
    np.testing.assert_array_equal(read_pt(write_pt(tmp_path / "i.pt", i64)).load(), i64)
    # compressed members are read too (bounded)
    pkl = tensor_pickle("FloatStorage", 4, (4,), (1,))
    p = write_pt_raw(tmp_path / "c.pt", pkl, np.ones(4, np.float32).tobytes(), zipfile.ZIP_DEFLATED)
    np.testing.assert_array_equal(read_pt(p).load(), np.ones(4, np.float32))


def test_pt_raw_words_of_plain_float_tensors_only(tmp_path):
    """open_pt_raw: the words of a contiguous float32/float16/bfloat16 tensor, equal to open_pt's
    array, read without numpy (kernels/compare_raw.py); None for everything else."""
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 5
    for arr, dtype, code, fmt in ((a, None, "f4", "f"), (a.astype(np.float16), None, "f2", "H"),
                                  (np.array([0x3F80, 0x7F80, 0xFFC0], np.uint16), "bfloat16", "bf16", "H")):
        for align in (64, 0):
            path = write_pt(tmp_path / f"{code}{align}.pt", arr, dtype=dtype, align=align)
            raw = open_pt_raw(path)
            assert raw is not None and (raw.code, raw.shape, raw.words.format) == (code, arr.shape, fmt)
            assert raw.words.tobytes() == open_pt(path).tobytes() == arr.tobytes()
    pkl = tensor_pickle("FloatStorage", 4, (4,), (1,))
    others = [write_pt(tmp_path / "f8.pt", a.astype(np.float64)), write_pt(tmp_path / "i8.pt", a.astype(np.int64)),
              write_pt(tmp_path / "t.pt", a[0], transpose=True),                 # a strided view
              write_pt(tmp_path / "e.pt", np.zeros((0, 3), np.float32)),         # no elements
              write_pt_raw(tmp_path / "z.pt", pkl, np.ones(4, np.float32).tobytes(), zipfile.ZIP_DEFLATED),
              write_pt_raw(tmp_path / "short.pt", pkl, np.ones(3, np.float32).tobytes())]   # refused by open_pt
    for path in others:
        assert open_pt_raw(path) is None, path.name
    (tmp_path / "junk.pt").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    assert open_pt_raw(tmp_path / "junk.pt") is None


@pytest.mark.parametrize("module,name", [("os", "system"), ("builtins", "eval"), ("posix", "system"),
                                         ("subprocess", "Popen"), ("torch", "load"),
                                         ("numpy.core.multiarray", "_reconstruct"), ("torch._utils", "x")])
def test_pt_forbidden_globals(tmp_path, module, name):
    marker = tmp_path / "pwned"
    pkl = b"\x80\x02" + f"c{module}\n{name}\n".encode() + _u(f"touch {marker}") + b"\x85R."
    p = write_pt_raw(tmp_path / "evil.pt", pkl, None)
    with pytest.raises(DumpError, match=f"forbidden global {module}.{name}"):
        read_pt(p)
    assert not marker.exists()


def test_pt_forbidden_global_protocol4_and_nested(tmp_path):
    p = write_pt_raw(tmp_path / "e4.pt", pickle.dumps(eval, protocol=4), None)
    with pytest.raises(DumpError, match="forbidden global builtins.eval"):
        read_pt(p)
    # an allowed prefix followed by a forbidden global in the storage slot
    bad = tensor_pickle("FloatStorage", 1, (1,), (1,)).replace(b"ctorch\nFloatStorage\n", b"cos\nsystem\n")
    with pytest.raises(DumpError, match="forbidden global os.system"):
        read_pt(write_pt_raw(tmp_path / "e5.pt", bad, b"\0" * 4))


def test_pt_hostile_structure(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"PK\x03\x04 definitely not a zip")
    with pytest.raises(DumpError, match="zip"):
        read_pt(tmp_path / "junk.pt")
    big = tensor_pickle("FloatStorage", 1000, (1000,), (1,))
    with pytest.raises(DumpError, match="storage declares"):
        read_pt(write_pt_raw(tmp_path / "short.pt", big, b"\0" * 16))
    view = tensor_pickle("FloatStorage", 4, (4, 4), (4, 1))
    with pytest.raises(DumpError, match="view reaches"):
        read_pt(write_pt_raw(tmp_path / "view.pt", view, b"\0" * 16))
    huge = tensor_pickle("FloatStorage", 1, (1 << 20, 1 << 20), (0, 0))
    with pytest.raises(DumpError, match="too large"):
        read_pt(write_pt_raw(tmp_path / "huge.pt", huge, b"\0" * 4))
    with pytest.raises(DumpError, match="missing"):
        read_pt(write_pt_raw(tmp_path / "nodata.pt", tensor_pickle("FloatStorage", 1, (1,), (1,)), None))
    with pytest.raises(DumpError, match="not a single tensor"):
        read_pt(write_pt_raw(tmp_path / "list.pt", pickle.dumps([1, 2], protocol=2), None))
    with pytest.raises(DumpError, match="bad pickle"):
        read_pt(write_pt_raw(tmp_path / "trunc.pt", big[:40], None))
    notcallable = b"\x80\x02ctorch\nFloatStorage\n)R."
    with pytest.raises(DumpError):
        read_pt(write_pt_raw(tmp_path / "nc.pt", notcallable, None))


def _forge_sizes(path: Path, declared: int) -> None:
    """Rewrite the uncompressed size of every member in the local and central headers."""
    raw = bytearray(path.read_bytes())
    for sig, off in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        pos = raw.find(sig)
        while pos >= 0:
            raw[pos + off: pos + off + 4] = struct.pack("<I", declared)
            pos = raw.find(sig, pos + 4)
    path.write_bytes(bytes(raw))


def test_zip_bombs(tmp_path):
    p = tmp_path / "bomb.npz"
    with zipfile.ZipFile(p, "w", compression=zipfile.ZIP_DEFLATED) as z:
        buf = io.BytesIO()
        np.save(buf, np.zeros(1000, np.float32))
        z.writestr("a.npy", buf.getvalue())
    _forge_sizes(p, 0xFFFFFFF0)
    with pytest.raises(DumpError, match="ratio|uncompressed"):
        read_npz(p)
    # an honest archive over the caller's budget
    q = tmp_path / "ok.npz"
    np.savez_compressed(q, a=np.zeros(100_000, np.float32))
    with pytest.raises(DumpError, match="uncompressed"):
        read_npz(q, max_uncompressed=1000)
    with pytest.raises(DumpError, match="members"):
        read_npz(q, max_members=0)
    pt = write_pt_raw(tmp_path / "b.pt", tensor_pickle("FloatStorage", 1, (1,), (1,)), b"\0" * 4,
                      zipfile.ZIP_DEFLATED)
    _forge_sizes(pt, 0x7FFFFFFF)
    with pytest.raises(DumpError):
        read_pt(pt)


# ----------------------------------------------------------------------------- synthetic: npy/npz

def test_npy_and_npz(tmp_path):
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    np.save(tmp_path / "x.npy", a)
    t = read_npy(tmp_path / "x.npy")
    assert (t.name, t.dtype, t.shape) == ("x", "float16", (2, 3))
    np.testing.assert_array_equal(t.load(), a)
    np.save(tmp_path / "f.npy", np.asfortranarray(np.arange(6.0).reshape(2, 3)))
    np.testing.assert_array_equal(read_npy(tmp_path / "f.npy").load(), np.arange(6.0).reshape(2, 3))
    np.savez(tmp_path / "s.npz", a=a, b=np.array([np.inf, 1.0]))
    np.savez_compressed(tmp_path / "c.npz", a=a, b=np.array([np.inf, 1.0]))
    for name in ("s.npz", "c.npz"):
        ts = read_npz(tmp_path / name)
        assert [x.name for x in ts] == ["a", "b"]
        np.testing.assert_array_equal(ts[0].load(), a)
        assert nonfinite_counts(ts[1].load()) == (0, 1, 0)


def test_npy_hostile(tmp_path):
    np.save(tmp_path / "t.npy", np.zeros(1000, np.float32))
    raw = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(raw[:500])
    with pytest.raises(DumpError, match="truncated"):
        read_npy(tmp_path / "t.npy")
    (tmp_path / "h.npy").write_bytes(raw[:30])
    with pytest.raises(DumpError):
        read_npy(tmp_path / "h.npy")
    (tmp_path / "g.npy").write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': os.sys}")
    with pytest.raises(DumpError):
        read_npy(tmp_path / "g.npy")
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DumpError, match="objects"):
        read_npy(tmp_path / "o.npy")
    np.savez(tmp_path / "o.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(DumpError, match="objects"):
        read_npz(tmp_path / "o.npz")
    (tmp_path / "z.npz").write_bytes(b"PK\x05\x06garbage")
    with pytest.raises(DumpError, match="zip"):
        read_npz(tmp_path / "z.npz")


# ----------------------------------------------------------------------------- synthetic: msprobe

def _synthetic_dump(root: Path) -> Path:
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    w = np.full((4, 4), 1e20, dtype=np.float32)
    y = x @ w
    loss = np.array(np.inf, dtype=np.float32)
    entries = {
        "Functional.linear.0.forward": {"input_args": [x, w, None], "input_kwargs": {}, "output": [y]},
        "Functional.layer_norm.0.forward": {"input_args": [y, [{"type": "int", "value": 4}], w[0]],
                                            "output": [y]},
        "Functional.mse_loss.0.forward": {"input_args": [y, x], "output": [loss]},
        "Functional.mse_loss.0.backward": {"input": [np.array(1.0, np.float32)], "output": [y, None]},
    }
    write_msprobe(root / "step3" / "rank1", entries)
    write_msprobe(root / "step4" / "proc77", entries, tensor_mode=False)
    return root


def test_msprobe_synthetic(tmp_path):
    root = _synthetic_dump(tmp_path / "dump")
    ts = read_msprobe_rank_dir(root / "step3" / "rank1")
    assert [(t.name, t.io, t.index) for t in ts][:5] == [
        ("Functional.linear.0.forward", "input", 0), ("Functional.linear.0.forward", "input", 1),
        ("Functional.linear.0.forward", "output", 0), ("Functional.layer_norm.0.forward", "input", 0),
        ("Functional.layer_norm.0.forward", "input", 2)]
    assert {t.step for t in ts} == {3} and {t.rank for t in ts} == {1}
    assert [t.order for t in ts] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3]
    assert all(t.dtype == "float32" and t.load is not None for t in ts)
    for t in ts:
        assert t.load().shape == t.shape
    first = first_nonfinite(ts)
    assert (first.name, first.io, first.index) == ("Functional.mse_loss.0.forward", "output", 0)
    stats_only = read_msprobe_rank_dir(root / "step4" / "proc77")
    assert all(t.load is None and t.stats is not None for t in stats_only)
    assert stats_only[0].rank is None and stats_only[0].step == 4
    sf = first_nonfinite(stats_only)
    assert sf.name == "Functional.mse_loss.0.forward" and sf.stats.pos_inf == 1
    everything = list_msprobe_dump(root)
    assert len(everything) == 2 * len(ts) and [t.step for t in everything][0] == 3


def test_msprobe_hostile(tmp_path):
    d = tmp_path / "step0" / "rank0"
    d.mkdir(parents=True)
    for text in ("garbage{", "[1, 2]", '{"data": []}', '{"data": {"a": 5}}', "[" * 100_000,
                 '{"task": "tensor", "data": {"x": {"output": [{"type": "torch.Tensor", '
                 '"dtype": "torch.float32", "shape": [-1]}]}}}',
                 '{"task": "tensor", "data": {"x": {"output": [{"type": "torch.Tensor", '
                 '"dtype": "torch.float32", "shape": [1], "data_name": "../../etc/passwd.pt"}]}}}',
                 '{"task": "tensor", "data": {"x": {"output": 7}}}'):
        (d / "dump.json").write_text(text)
        with pytest.raises(DumpError):
            read_msprobe_rank_dir(d)
    (d / "dump.json").write_text('{"data": {}}' + " " * 5000)
    with pytest.raises(DumpError, match="limit"):
        read_msprobe_rank_dir(d, max_json=1000)
    # a tensor file whose shape disagrees with dump.json fails on load, not silently
    (d / "dump_tensor_data").mkdir()
    write_pt(d / "dump_tensor_data" / "x.output.0.pt", np.zeros(3, np.float32))
    (d / "dump.json").write_text(json.dumps({"task": "tensor", "data": {"x": {"output": [
        {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [4], "data_name": "x.output.0.pt"}]}}}))
    (t,) = read_msprobe_rank_dir(d)
    with pytest.raises(DumpError, match="shape"):
        t.load()


# ----------------------------------------------------------------------------- synthetic: MindSpore

def test_mindspore_names_and_csv(tmp_path):
    meta = parse_npy_name("Add.Default_network-Add-op1.12.0.1673383728093446.output.0.DefaultFormat.float32.npy")
    assert meta["op_type"] == "Add" and meta["io"] == "output" and meta["dtype"] == "float32"
    old = parse_npy_name("MatMul.op2.3.1.1673383728093447.input.1.NCHW.npy")
    assert old["format"] == "NCHW" and old["dtype"] is None
    assert parse_npy_name("random.npy") is None
    it = tmp_path / "rank_2" / "net" / "0" / "5"
    it.mkdir(parents=True)
    np.save(it / "MatMul.op2.3.1.20.output.0.ND.float32.npy", np.ones((2, 2), np.float32))
    np.save(it / "MatMul.op2.3.1.20.input.0.ND.float32.npy", np.zeros((2, 2), np.float32))
    np.save(it / "Add.op1.2.1.10.output.0.ND.float32.npy", np.array([np.nan], np.float32))
    ts = read_mindspore_npy_dir(it)
    assert [(t.name, t.io) for t in ts] == [("op1", "output"), ("op2", "input"), ("op2", "output")]
    assert ts[0].step == 5 and ts[0].rank == 2 and nonfinite_counts(ts[0].load()) == (1, 0, 0)
    (it / "statistic.csv").write_text(
        "Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,Data Type,Shape,"
        "Max Value,Min Value,Avg Value,Count,NaN Count,Negative Inf Count,Positive Inf Count,L2Norm Value\n"
        'Add,op1,2,1,10,output,0,4,float32,"(1,)",nan,nan,nan,1,1,0,0,nan\n'
        'MatMul,op2,3,1,20,input,0,16,float32,"(2,2)",0,0,0,4,0,0,0,0\n')
    rows = read_statistic_csv(it / "statistic.csv")
    assert [(r.name, r.shape, r.stats.nan) for r in rows] == [("op1", (1,), 1), ("op2", (2, 2), 0)]
    (it / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DumpError, match="statistic.csv"):
        read_statistic_csv(it / "bad.csv")


# ----------------------------------------------------------------------------- the corpus

L1_FORWARD = [
    "Functional.layer_norm.0", "Functional.linear.0", "Torch.matmul.0", "Tensor.__mul__.0",
    "Torch.softmax.0", "Torch.matmul.1", "Functional.linear.1", "Tensor.__add__.0",
    "Functional.layer_norm.1", "Functional.linear.2", "Functional.gelu.0", "Functional.linear.3",
    "Tensor.__add__.1", "Functional.layer_norm.2", "Functional.linear.4", "Torch.matmul.2",
    "Tensor.__mul__.1", "Torch.softmax.1", "Torch.matmul.3", "Functional.linear.5",
    "Tensor.__add__.2", "Functional.layer_norm.3", "Functional.linear.6", "Functional.gelu.1",
    "Functional.linear.7", "Tensor.__add__.3", "Tensor.mean.0", "Functional.linear.8",
    "Functional.mse_loss.0"]
SETS = ["bench", "same", "drift", "nan", "stats_bench", "stats_drift", "stats_nan"]


def _ground_truth() -> dict:
    return json.loads(corpus_path("msprobe", "ground_truth.json").read_text())


def _record(gt: dict, name: str, step: int) -> dict:
    if name == "bench":  # bench has no record of its own; it is the clean twin of "same"
        name = "same"
    return next(r for r in gt["pairs"] if r["set"] == name and r["step"] == step)


def _entries(ts: list[DumpTensor]) -> list[str]:
    names: list[str] = []
    for t in ts:
        if not names or names[-1] != t.name:
            names.append(t.name)
    return names


def _key(t: DumpTensor) -> tuple:
    return (t.name, t.extra["slot"], t.extra["arg"])


@pytest.mark.parametrize("set_name", SETS)
@pytest.mark.parametrize("step", [0, 1])
def test_corpus_set(set_name, step):
    gt = _ground_truth()
    rec = _record(gt, set_name, step)
    rank_dir = corpus_path("msprobe", set_name, f"step{step}", "rank0")
    ts = read_msprobe_rank_dir(rank_dir)
    entries = _entries(ts)
    assert len(entries) == rec["n_entries"] == len({t.order for t in ts})
    api = [t for t in ts if not t.name.startswith("Module.")]
    assert len(api) == 163
    assert len(ts) == (163 if rec["level"] == "L1" else 289)
    api_entries = [e for e in entries if not e.startswith("Module.")]
    assert api_entries[:29] == [f"{n}.forward" for n in L1_FORWARD]
    assert api_entries[29] == "Functional.mse_loss.0.backward" and api_entries[-1] == "Functional.layer_norm.0.backward"
    assert {t.dtype for t in ts} == {"float32"} and {(t.step, t.rank) for t in ts} == {(step, 0)}
    # same structure as bench, item by item
    bench = read_msprobe_rank_dir(corpus_path("msprobe", "bench", f"step{step}", "rank0"))
    assert [(_key(t), t.shape) for t in api] == [(_key(t), t.shape) for t in bench]
    tensor_mode = rec["task"] == "tensor"
    assert all((t.load is not None) == tensor_mode for t in ts)

    nonfinite = []
    for t in ts:
        if tensor_mode:
            arr = t.load()
            assert arr.shape == t.shape and arr.dtype == np.float32
            counts = nonfinite_counts(arr)
            if sum(counts):
                nonfinite.append((t.name, t.extra["slot"], t.extra["arg"], counts))
            # dump.json Max/Min agree with the data
            if arr.size and not sum(counts):
                assert float(arr.max()) == t.stats.max and float(arr.min()) == t.stats.min
        elif t.stats.nonfinite:
            nonfinite.append((t.name, t.extra["slot"], t.extra["arg"]))
    if tensor_mode:
        want = [(r["op"], r["slot"], str(r["index"]), (r["n_nan"], r["n_posinf"], r["n_neginf"]))
                for r in rec.get("nonfinite_tensors", [])]
    else:
        want = [(r["op"], r["slot"], str(r["index"])) for r in rec["nonfinite_by_maxmin"]]
    assert nonfinite == want

    first = first_nonfinite(ts)
    expected = rec["first_nonfinite_tensor"] if tensor_mode else rec["first_nonfinite_maxmin"]
    if expected is None:
        assert first is None
    else:
        assert (first.name, first.extra["slot"], first.index) == (expected["op"], expected["slot"], expected["index"])

    loss = next(t for t in ts if t.name == "Functional.mse_loss.0.forward" and t.io == "output")
    value = float(loss.load()) if tensor_mode else loss.stats.max
    assert repr(value) == gt["losses"][set_name]["dumped"][step]


@pytest.mark.parametrize("set_name", ["same", "drift", "nan"])
@pytest.mark.parametrize("step", [0, 1])
def test_corpus_first_diff(set_name, step):
    rec = _record(_ground_truth(), set_name, step)
    ts = read_msprobe_rank_dir(corpus_path("msprobe", set_name, f"step{step}", "rank0"))
    bench = read_msprobe_rank_dir(corpus_path("msprobe", "bench", f"step{step}", "rank0"))
    diffs = [t for t, b in zip(ts, bench) if not np.array_equal(t.load(), b.load())]
    assert len(diffs) == rec["n_diff_tensors"]
    if rec["first_diff"] is None:
        assert not diffs
    else:
        fd = rec["first_diff"]
        assert (diffs[0].name, diffs[0].extra["slot"], diffs[0].index) == (fd["op"], fd["slot"], fd["index"])
        assert os.path.basename(diffs[0].path) == fd["file"]


def test_corpus_list_all_steps():
    ts = list_msprobe_dump(corpus_path("msprobe", "nan"))
    assert [t.step for t in ts] == [0] * 163 + [1] * 163
    assert first_nonfinite(ts).step == 1
