"""CANN binary dumps, mapping.csv, Opdebug records and overflow-to-op lookup."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:
    from support import dumps as W
except ImportError:  # pragma: no cover - run from the repository root as a package
    from tests.support import dumps as W

from precision_agent.dumps import protobuf as pb
from precision_agent.dumps.cann import (list_dump_dir, parse_dump_name, read_cann_dump,
                                        read_cann_dump_ex, read_mapping_csv)
from precision_agent.dumps.opdebug import (decode_record, decode_status, find_overflow_ops,
                                           read_opdebug)
from precision_agent.dumps.types import DumpError

TS = 1673383728093446


# --- names ------------------------------------------------------------------------------------
def test_parse_classic_and_old_names():
    m = parse_dump_name(f"Conv2D.conv1_Conv2D.12.3.{TS}")
    assert m["op_type"] == "Conv2D" and m["op_name"] == "conv1_Conv2D"
    assert (m["task_id"], m["stream_id"], m["timestamp"], m["ffts"]) == (12, 3, TS, False)
    m = parse_dump_name(f"/x/y/Add.add-1.7.{TS}")
    assert (m["task_id"], m["stream_id"], m["timestamp"]) == (7, None, TS)


def test_parse_ffts_name():
    m = parse_dump_name("Add.partition0_rank1_new_sub_graph1_sgt_graph_0_Add.0.3."
                        "1673383728093446.4.1.0.0")
    assert m["op_name"] == "partition0_rank1_new_sub_graph1_sgt_graph_0_Add"
    assert (m["task_id"], m["stream_id"], m["timestamp"]) == (0, 3, TS)
    assert (m["task_type"], m["context_id"], m["thread_id"], m["device_id"]) == (4, 1, 0, 0)
    assert m["ffts"] is True


def test_parse_opdebug_and_rejects():
    m = parse_dump_name(W.opdebug_name(5, 2, TS))
    assert m["is_opdebug"] and m["task_id"] == 5
    assert parse_dump_name(f"OpDebug.Node_Opdebug.5.2.{TS}")["is_opdebug"]
    for bad in ("mapping.csv", f"Add.x.1.2.{TS}.output.0.npy", "Add.x.1", "a b.c.1.2",
                f"Add.x/y.1.{TS}", "Add..1.2", f"Add.x.1.2.{TS}.9", "", "...."):
        assert parse_dump_name(bad) is None, bad


# --- round trips ------------------------------------------------------------------------------
def test_round_trip_dtypes_shapes(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3)).astype(np.float16)
    b = rng.integers(-100, 100, (4,), dtype=np.int32)
    bf = np.array([0x3F80, 0x7FC0, 0xFF80, 0x0000], dtype=np.uint16)   # 1, nan, -inf, 0
    c = rng.standard_normal((3, 1, 2)).astype(np.float32)
    s = np.array(True)
    d = rng.integers(0, 255, (5,), dtype=np.uint8).astype(np.int8)
    path = str(tmp_path / W.dump_name("MatMul", "mm_1", 4, 1, TS))
    W.write_cann_dump(path, inputs=[W.tensor(a), W.tensor(b), W.tensor(bf, dtype="bfloat16")],
                      outputs=[W.tensor(c), W.tensor(s), W.tensor(d)], op_name="mm/1",
                      buffers=[b"\x00" * 16])
    ts = read_cann_dump(path)
    assert [(t.io, t.index, t.dtype, t.shape) for t in ts] == [
        ("input", 0, "float16", (2, 3)), ("input", 1, "int32", (4,)),
        ("input", 2, "bfloat16", (4,)), ("output", 0, "float32", (3, 1, 2)),
        ("output", 1, "bool", ()), ("output", 2, "int8", (5,))]
    for t, ref in zip(ts, [a, b, bf, c, s, d]):
        got = t.load()
        assert got.shape == ref.shape and np.array_equal(got, ref, equal_nan=True)
        assert t.name == "mm_1" and t.op_type == "MatMul" and t.order == 0
    assert ts[2].load().dtype == np.uint16
    assert ts[0].extra["proto_op_name"] == "mm/1"
    assert (ts[0].extra["task_id"], ts[0].extra["stream_id"]) == (4, 1)


def test_original_shape_and_device_format(tmp_path):
    host = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    dev = np.zeros((1, 1, 2, 2, 16), dtype=np.float16)       # NC1HWC0, C=3 padded to 16
    dev[..., :3] = 1.5
    path = str(tmp_path / W.dump_name("Conv", "c", 1, 0, TS))
    flat = W.tensor(host.reshape(-1), original_shape=(2, 3, 4))
    W.write_cann_dump(path, inputs=[flat], outputs=[
        W.tensor(dev, fmt="NC1HWC0", original_shape=(1, 3, 2, 2))])
    i0, o0 = read_cann_dump(path)
    assert i0.shape == (2, 3, 4) and np.array_equal(i0.load(), host)
    assert o0.shape == (1, 3, 2, 2) and o0.extra["format"] == "NC1HWC0" and o0.extra["padded"]
    assert o0.extra["device_shape"] == (1, 1, 2, 2, 16)
    assert o0.load().shape == (64,) and np.array_equal(o0.load(), dev.reshape(-1))


def test_unpacked_shape_and_unsupported_dtype(tmp_path):
    x = W.tensor(np.ones((2, 2), np.float32))
    x["packed"] = False
    y = W.tensor(np.zeros(4, np.uint8), dtype_code=13)           # DT_STRING
    path = str(tmp_path / W.dump_name("A", "a", 1, 0, TS))
    W.write_cann_dump(path, inputs=[x], outputs=[y])
    ts, skipped = read_cann_dump_ex(path)
    assert len(ts) == 1 and ts[0].shape == (2, 2)
    assert len(skipped) == 1 and "DT_STRING" in skipped[0]


def test_empty_tensor(tmp_path):
    path = str(tmp_path / W.dump_name("A", "a", 1, 0, TS))
    W.write_cann_dump(path, inputs=[W.tensor(np.zeros((0, 3), np.float32))],
                      outputs=[W.tensor(np.ones(1, np.float32))])
    t = read_cann_dump(path)[0]
    assert t.shape == (0, 3) and t.load().size == 0


# --- directories and mapping.csv -------------------------------------------------------------
def test_dir_order_mapping_and_errors(tmp_path):
    d = tmp_path
    W.write_cann_dump(str(d / W.dump_name("B", "second", 2, 0, TS + 50)),
                      outputs=[W.tensor(np.full(2, 2.0, np.float32))])
    W.write_cann_dump(str(d / W.dump_name("Z", "first", 9, 0, TS + 10)),
                      outputs=[W.tensor(np.full(2, 1.0, np.float32))])
    short = "12345678901234567890123456789012"
    W.write_cann_dump(str(d / short), outputs=[W.tensor(np.full(2, 3.0, np.float32))])
    long_real = W.dump_name("Long", "a_very_long_name" * 5, 3, 0, TS + 90)
    (d / "mapping.csv").write_text(f"{short},{long_real}\nbroken\n")
    (d / "notes.txt").write_text("hello")
    (d / W.dump_name("C", "bad", 1, 0, TS + 70)).write_bytes(b"\x05" + b"\x00" * 20)
    W.write_opdebug(str(d / W.opdebug_name(1, 0, TS + 80)), W.old_record({}))
    assert read_mapping_csv(str(d / "mapping.csv")) == {short: long_real}
    tensors, errors = list_dump_dir(str(d))
    assert [t.name for t in tensors] == ["first", "second", "a_very_long_name" * 5]
    assert [t.order for t in tensors] == [0, 1, 2]
    assert [float(t.load()[0]) for t in tensors] == [1.0, 2.0, 3.0]
    assert tensors[2].op_type == "Long" and tensors[2].extra["file_name"] == long_real
    assert len(errors) == 1 and "bad" in errors[0][0]


def test_symlinked_short_name_counted_once(tmp_path):
    real = W.dump_name("A", "a", 1, 0, TS)
    W.write_cann_dump(str(tmp_path / real), outputs=[W.tensor(np.ones(1, np.float32))])
    os.symlink(real, tmp_path / "abc")
    (tmp_path / "mapping.csv").write_text(f"abc,{real}\n")
    tensors, errors = list_dump_dir(str(tmp_path))
    assert len(tensors) == 1 and not errors and tensors[0].path.endswith(real)


# --- hostile files ----------------------------------------------------------------------------
def _bad(tmp_path, data: bytes) -> str:
    p = tmp_path / W.dump_name("A", "a", 1, 0, TS)
    p.write_bytes(data)
    return str(p)


def test_truncated_and_inconsistent(tmp_path):
    good = W.encode_dump_data([], [W.tensor(np.ones(4, np.float32))])
    cases = {
        "short": b"\x01\x02\x03",
        "eight": struct.pack("<Q", 0),
        "hlen>file": struct.pack("<Q", 10 ** 12) + good,
        "missing data": struct.pack("<Q", len(good)) + good + b"\x00" * 15,
        "extra data": struct.pack("<Q", len(good)) + good + b"\x00" * 17,
        "header garbage": struct.pack("<Q", 4) + b"\xff\xff\xff\xff",
    }
    for why, data in cases.items():
        with pytest.raises(DumpError):
            read_cann_dump(_bad(tmp_path, data))
    huge = W.tensor(np.ones(4, np.float32), size=2 ** 63)
    with pytest.raises(DumpError, match="declared sizes"):
        read_cann_dump(W.write_cann_dump(str(tmp_path / "h"), outputs=[huge]))
    odd = W.tensor(np.ones(3, np.uint8), dtype_code=1)       # 3 bytes of float32
    with pytest.raises(DumpError, match="multiple"):
        read_cann_dump(W.write_cann_dump(str(tmp_path / "o"), outputs=[odd]))


def test_protobuf_hostile():
    with pytest.raises(DumpError, match="nesting"):
        inner = b""
        for _ in range(200):
            inner = W.f_bytes(1, inner)
        schema: dict = {}
        schema[1] = ("child", "message", False, schema)
        pb.decode_message(inner, schema)
    for data in (W.key(3, 2) + W.varint(2 ** 62), W.key(1, 3), W.key(1, 4), W.key(1, 6),
                 W.key(1, 1) + b"\x00" * 3, W.key(1, 5) + b"\x00", b"\x80" * 11, b"\x80",
                 W.key(0, 0) + b"\x00", W.key(2, 0) + b"\xff" * 9 + b"\x7f"):
        with pytest.raises(DumpError):
            pb.decode_dump_data(data)
    with pytest.raises(DumpError, match="expected"):
        pb.decode_dump_data(W.f_varint(3, 5))              # output must be a message
    assert pb.decode_fields(W.f_varint(1, 300) + W.f_str(2, "hi")) == {1: [300], 2: [b"hi"]}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400), st.booleans())
def test_random_bytes_never_crash(tmp_path, data, with_header):
    if with_header:
        data = struct.pack("<Q", len(data)) + data
    p = _bad(tmp_path, data)
    for fn in (read_cann_dump, read_opdebug):
        try:
            fn(p)
        except DumpError:
            pass
    try:
        pb.decode_dump_data(data)
        decode_record(data)
    except DumpError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.sampled_from([0, 1, 2, 5]),
                          st.integers(0, 2 ** 64 - 1), st.binary(max_size=20)), max_size=12))
def test_random_wellformed_protobuf(fields):
    msg = b""
    for num, wire, v, blob in fields:
        if wire == 0:
            msg += W.f_varint(num, v)
        elif wire == 1:
            msg += W.key(num, 1) + struct.pack("<Q", v)
        elif wire == 5:
            msg += W.key(num, 5) + struct.pack("<I", v & 0xFFFFFFFF)
        else:
            msg += W.f_bytes(num, blob)
    raw = pb.decode_fields(msg)
    assert sum(len(v) for v in raw.values()) == len(fields)
    try:
        pb.decode_dump_data(msg)
    except DumpError:
        pass


# --- Opdebug ----------------------------------------------------------------------------------
def test_old_record_status_bits(tmp_path):
    rec = W.old_record({
        "AI Core": {"model_id": 1, "stream_id": 2, "task_id": 30, "status": 0x20 | 0x400},
        "DHA Atomic Add": {"stream_id": 2, "task_id": 31, "status": 0x0900},
        "L2 Atomic Add": {"stream_id": 2, "task_id": 32, "status": 0b011 << 16},
    })
    p = W.write_opdebug(str(tmp_path / W.opdebug_name(99, 2, TS)), rec)
    recs = {r.accelerator: r for r in read_opdebug(p)}
    assert recs["AI Core"].flags == ("float_overflow", "cube_accumulation_overflow")
    assert recs["AI Core"].task_id == 30 and recs["AI Core"].extra["block_idx"] == 3
    # precision_tool looks up the whole status (0x900) and finds nothing: we read bits 8..15
    assert recs["DHA Atomic Add"].flags == ("overflow",)
    assert recs["L2 Atomic Add"].flags == ("src_nan",)
    assert all(r.timestamp == TS and r.layout == "old" for r in recs.values())
    assert decode_status("AI Core", 0x8 | 0x10 | 0x80 | 0x100 | 0x1) == (
        "int_min_negation", "int_overflow", "negative_to_unsigned", "fp16_conversion_overflow",
        "unknown_bits_0x1")
    assert decode_status("DHA Atomic Add", 0x0D00) == ("both_nan",)
    assert decode_status("L2 Atomic Add", 0) == ()


def test_old_record_minus_one_falls_back_to_name(tmp_path):
    rec = W.old_record({"AI Core": {"stream_id": -1, "task_id": -1, "status": 0x20}})
    p = W.write_opdebug(str(tmp_path / W.opdebug_name(7, 3, TS)), rec)
    (r,) = read_opdebug(p)
    assert (r.task_id, r.stream_id) == (7, 3) and r.extra["ids_from_file_name"]


def test_new_record_layouts():
    aic = W.new_record(0, [1, 5, 40, 0, 65535, 65535, 0x10, 0x20, 2, 3], [0x20])
    (r,) = decode_record(aic)
    assert (r.accelerator, r.task_id, r.stream_id, r.layout) == ("AI Core", 40, 5, "new")
    assert r.context_id is None and r.thread_id is None and r.flags == ("float_overflow",)
    v1 = W.new_record(1, [1, 5, 41, 0, 2, 0, 0, 0, 0, 0], [0, 0x100, 0, 0], version=1)
    (r,) = decode_record(v1)
    assert r.accelerator == "AI Vector" and r.flags == ("fp16_conversion_overflow",)
    assert r.context_id == 2 and r.thread_id == 0 and r.extra["status_words"] == [0, 0x100, 0, 0]
    (r,) = decode_record(W.new_record(2, [1, 5, 42, 1, 0, 3, 0], [7]))
    assert r.accelerator == "AI CPU" and r.flags == ("status_0x7",)
    (r,) = decode_record(W.new_record(3, [1, 5, 43, 2, 0, 0, 1, 2, 4], [1]))
    assert r.accelerator == "SDMA" and r.extra["channel_id"] == 4
    assert decode_record(W.new_record(0, [0] * 10, [0x20], valid=0)) == []
    assert decode_record(W.new_record(0, [0] * 10, [0])) == []
    for bad in (W.new_record(9, [0] * 10, [1]), W.new_record(0, [0] * 10, [1], data_len=999),
                W.new_record(0, [0] * 3, [1]), b"\x5a\x5a\x5a\x5a\x00", b"\x00" * 100):
        with pytest.raises(DumpError):
            decode_record(bad)


def _overflow_dir(tmp_path):
    d = tmp_path
    arr = np.array([65504, np.inf], dtype=np.float16)
    # decoy: the op whose task id equals the debug file's *name* task id
    W.write_cann_dump(str(d / W.dump_name("Mul", "decoy", 9, 0, TS + 1)),
                      outputs=[W.tensor(np.ones(2, np.float16))])
    W.write_cann_dump(str(d / W.dump_name("Add", "real_add", 40, 0, TS + 5)),
                      inputs=[W.tensor(np.ones(2, np.float16))], outputs=[W.tensor(arr)])
    W.write_cann_dump(str(d / W.dump_name("Add", "same_task_other_stream", 40, 1, TS + 6)),
                      outputs=[W.tensor(np.ones(2, np.float16))])
    W.write_cann_dump(str(d / W.dump_name("Cast", "cast_later", 41, 0, TS + 100)),
                      outputs=[W.tensor(arr)])
    # the later overflow sorts first by name ("10" < "9") but must come second
    W.write_opdebug(str(d / W.opdebug_name(10, 0, TS + 101)), W.new_record(
        0, [1, 0, 41, 0, 65535, 65535, 0, 0, 0, 0], [0x20]))
    W.write_opdebug(str(d / W.opdebug_name(9, 0, TS + 7)), W.old_record(
        {"AI Core": {"stream_id": 0, "task_id": 40, "status": 0x20}}))
    (d / W.opdebug_name(11, 0, TS + 200)).write_bytes(b"\x00" * 9)
    return d


def test_find_overflow_ops(tmp_path):
    d = _overflow_dir(tmp_path)
    tensors, errors = list_dump_dir(str(d))
    assert not errors
    debug = [str(d / f) for f in os.listdir(d) if parse_dump_name(f)["is_opdebug"]]
    errs: list = []
    ops = find_overflow_ops(debug, tensors, errors=errs)
    assert [o.op_name for o in ops] == ["real_add", "cast_later"]
    assert ops[0].record.flags == ("float_overflow",) and ops[0].op_type == "Add"
    assert [t.io for t in ops[0].tensors] == ["input", "output"]
    assert np.isinf(ops[0].tensors[1].load()).sum() == 1
    assert len(errs) == 1 and "Opdebug.Node_OpDebug.11" in errs[0][0]
    assert [o.op_name for o in find_overflow_ops(debug, tensors, limit=1)] == ["real_add"]


def test_overflow_without_matching_dump(tmp_path):
    p = W.write_opdebug(str(tmp_path / W.opdebug_name(1, 0, TS)), W.old_record(
        {"AI Core": {"stream_id": 0, "task_id": 77, "status": 0x20}}))
    (op,) = find_overflow_ops([p], [])
    assert op.path is None and op.record.task_id == 77


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), min_size=1,
                max_size=6), st.integers(0, 10 ** 6))
def test_mutated_valid_dump_never_crashes(tmp_path, flips, cut):
    header = W.encode_dump_data([W.tensor(np.ones((2, 3), np.float16))],
                                [W.tensor(np.zeros(4, np.float32), original_shape=(2, 2))])
    data = bytearray(struct.pack("<Q", len(header)) + header + b"\x00" * 28)
    for pos, val in flips:
        data[pos % len(data)] = val
    data = data[:max(1, len(data) - cut % 8)] if cut % 3 == 0 else data
    p = _bad(tmp_path, bytes(data))
    try:
        for t in read_cann_dump(p):
            t.load()
    except DumpError:
        pass
