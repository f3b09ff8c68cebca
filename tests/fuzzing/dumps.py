"""Fuzz targets of the dump readers: each writes a damaged dump tree and scans it the way
``precision-agent scan`` and the daemon's scan thread do (``scan_dump`` + ``result_samples``).

``scan_dump`` reports unreadable files and trees in its result: it documents no exception, so
any exception out of it is a failure. The protobuf decoder documents ``DumpError`` only.
"""

from __future__ import annotations

import io
import json
import random
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from support import dumps as W
from precision_agent.compare.engine import compare_paths
from precision_agent.compare.report import format_text, to_json
from precision_agent.dumps.protobuf import decode_dump_data
from precision_agent.dumps.scan import scan_dump
from precision_agent.dumps.samples import result_samples
from precision_agent.dumps.types import DumpError
from precision_agent.model import json_safe

from .core import Target
from .mutate import mutate_bytes, mutate_tree, pick

DTYPES = ["float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"]
_STORAGE = {"float32": "FloatStorage", "float16": "HalfStorage", "float64": "DoubleStorage",
            "int64": "LongStorage", "bool": "BoolStorage", "int32": "IntStorage", "int8": "CharStorage",
            "uint8": "ByteStorage"}
Files = list[tuple[str, bytes]]  # (relative path, content): what a case writes before scanning


def small_array(rng: random.Random, dtype: str | None = None) -> np.ndarray:
    dtype = dtype or pick(rng, DTYPES)
    shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3)))
    a = np.array([rng.choice((0.0, 1.5, -2.0, 65504.0, 1e30, float("nan"), float("inf")))
                  for _ in range(int(np.prod(shape)))], dtype=np.float64)
    with np.errstate(all="ignore"):
        return a.astype(dtype).reshape(shape)


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _npy_header_edit(rng: random.Random, b: bytes) -> bytes:
    """Rewrite the header dict with hostile shapes, dtypes and orders (same or other length)."""
    end = b.find(b"}")
    if not b.startswith(b"\x93NUMPY") or end < 0:
        return b
    hdr = b[10:end + 1].decode("latin-1")
    field = rng.randrange(3)
    if field == 0:
        hdr = hdr.replace(hdr[hdr.find("'shape'"):hdr.find(")", hdr.find("'shape'")) + 1],
                          "'shape': " + pick(rng, ["(1099511627776,)", "(-1,)", "(4294967296, 4294967296)", "()",
                                                   "(0,)", "(3, 'a')", "(1.5,)", "(" + "2, " * 70 + ")", "None"]))
    elif field == 1:
        hdr = hdr.replace(hdr[hdr.find("'descr'"):hdr.find(",", hdr.find("'descr'"))],
                          "'descr': " + pick(rng, ["'|O'", "'<V8'", "'<U4'", "'>f4'", "'<c16'", "'<f16'", "'x'",
                                                   "[('a', '<f4')]", "'<M8[s]'", "1"]))
    else:
        hdr = hdr.replace("False", pick(rng, ["True", "1", "None", "'yes'"]))
    body = hdr.encode("latin-1")
    return b[:8] + struct.pack("<H", len(body)) + body + b[end + 1:]


def _make_npy(rng: random.Random) -> Files:
    files: Files = []
    for k in range(rng.randint(1, 3)):
        a = small_array(rng)
        if rng.random() < 0.3:
            with io.BytesIO() as buf:
                (np.savez_compressed if rng.random() < 0.5 else np.savez)(buf, a=a, b=small_array(rng))
                raw, name = buf.getvalue(), f"t{k}.npz"
            raw = mutate_bytes(rng, raw, hot=len(raw)) if rng.random() < 0.8 else raw
        else:
            raw, name = npy_bytes(a), f"t{k}.npy"
            if rng.random() < 0.5:
                raw = _npy_header_edit(rng, raw)
            if rng.random() < 0.6:
                raw = mutate_bytes(rng, raw, hot=128)
        files.append((f"d{k % 2}/{name}", raw))
    return files


def tensor_pickle(storage: str, numel: int, size: Any, stride: Any, offset: int = 0) -> bytes:
    def u(s: str) -> bytes:
        b = s.encode()
        return b"X" + struct.pack("<I", len(b)) + b

    def i(v: int) -> bytes:
        return b"J" + struct.pack("<i", max(min(v, 2 ** 31 - 1), -2 ** 31))

    def tup(vals: Any) -> bytes:
        return b"(" + b"".join(i(v) for v in vals) + b"t"
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((" + u("storage") + f"ctorch\n{storage}\n".encode()
            + u("0") + u("cpu") + i(numel) + b"tQ" + i(offset) + tup(size) + tup(stride)
            + b"\x89ccollections\nOrderedDict\n)Rt" + b"R.")


def pt_bytes(rng: random.Random, a: np.ndarray, stem: str) -> bytes:
    dtype = a.dtype.name
    c = np.ascontiguousarray(a)
    shape, numel = list(a.shape), a.size
    stride = [s // max(a.itemsize, 1) for s in c.strides]
    offset = 0
    if rng.random() < 0.5:  # lie about the view
        which = rng.randrange(4)
        if which == 0:
            shape = [rng.choice((2 ** 31 - 1, 0, -1, 65536)) for _ in shape or [1]]
        elif which == 1:
            stride = [rng.choice((0, -1, 2 ** 31 - 1, 3)) for _ in shape]
        elif which == 2:
            offset = rng.choice((-1, 2 ** 31 - 1, numel + 1))
        else:
            numel = rng.choice((0, 2 ** 31 - 1, -5))
    storage = _STORAGE.get(dtype, "FloatStorage")
    if rng.random() < 0.1:
        storage = pick(rng, ["UntypedStorage", "ComplexFloatStorage", "os\nsystem", "Nope"])
    pkl = tensor_pickle(storage, numel, shape, stride, offset)
    if rng.random() < 0.2:
        pkl = mutate_bytes(rng, pkl, hot=len(pkl))
    if rng.random() < 0.05:
        pkl = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueR."
    buf = io.BytesIO()
    comp = zipfile.ZIP_DEFLATED if rng.random() < 0.3 else zipfile.ZIP_STORED
    with zipfile.ZipFile(buf, "w", compression=comp) as z:
        z.writestr(f"{stem}/data.pkl", pkl)
        z.writestr(f"{stem}/byteorder", "little")
        if rng.random() < 0.95:
            z.writestr(f"{stem}/data/0", c.tobytes())
        z.writestr(f"{stem}/version", "3\n")
    raw = buf.getvalue()
    return mutate_bytes(rng, raw, hot=len(raw)) if rng.random() < 0.3 else raw


def _item(a: np.ndarray, data_name: str | None) -> dict:
    with np.errstate(all="ignore"):
        f = a.astype(np.float64)
        d = {"type": "torch.Tensor", "dtype": f"torch.{a.dtype.name}", "shape": list(a.shape),
             "Max": float(f.max()) if f.size else None, "Min": float(f.min()) if f.size else None,
             "Mean": float(f.mean()) if f.size else None, "Norm": float(np.sqrt((f * f).sum())),
             "requires_grad": False}
    if data_name:
        d["data_name"] = data_name
    return d


def _make_msprobe(rng: random.Random) -> Files:
    files: Files = []
    tensor_mode = rng.random() < 0.6
    data: dict[str, Any] = {}
    for k in range(rng.randint(1, 3)):
        key = pick(rng, ["Functional.linear", "Tensor.add", "Module.fc1.Linear", "Torch.matmul"]) + f".{k}.forward"
        slots: dict[str, Any] = {}
        for slot, io_ in (("input_args", "input"), ("output", "output")):
            a = small_array(rng, pick(rng, ["float32", "float16", "float64", "int64", "bool"]))
            name = f"{key}.{io_}.0.pt" if tensor_mode else None
            if name:
                files.append((f"step0/rank0/dump_tensor_data/{name}", pt_bytes(rng, a, name[:-3])))
            slots[slot] = [_item(a, name)]
        data[key] = slots
    doc = {"task": "tensor" if tensor_mode else "statistics", "level": "L1", "framework": "pytorch",
           "dump_data_dir": None, "data": data}
    if rng.random() < 0.7:
        doc = mutate_tree(rng, doc, ["data_name", "shape", "dtype", "Max", "Min", "type", "input_args", "output",
                                     "task", "level", "framework", "data"])
        if rng.random() < 0.2 and isinstance(doc, dict):
            doc["data"] = {"x.forward": {"output": [{"type": "torch.Tensor", "dtype": "torch.float32",
                                                     "shape": [1], "data_name": pick(rng, [
                                                         "../../../../etc/passwd", "/etc/passwd", "a/../../x.pt",
                                                         "x.pt\x00.npy", "." * 300 + ".pt", "con.pt"])}]}}
    text = json.dumps(doc, allow_nan=True, default=str)[:1 << 20]  # duplicated subtrees can reach MBs
    raw = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.3:
        raw = mutate_bytes(rng, raw, hot=len(raw))
    files.append(("step0/rank0/dump.json", raw))
    return files


def _make_cann(rng: random.Random) -> Files:
    files: Files = []
    for k in range(rng.randint(1, 2)):
        ins = [W.tensor(small_array(rng, pick(rng, ["float32", "float16", "int32", "int64"])))
               for _ in range(rng.randint(0, 2))]
        outs = [W.tensor(small_array(rng, pick(rng, ["float32", "float16"])))]
        for t in ins + outs:
            if rng.random() < 0.2:
                t[pick(rng, ["size", "shape", "dtype_code", "original_shape"])] = pick(
                    rng, [2 ** 40, 0, [2 ** 31, 2 ** 31], [], 999, [1] * 40])
        try:
            header = W.encode_dump_data(ins, outs, op_name=f"op{k}")
        except (KeyError, TypeError, ValueError, struct.error, OverflowError):
            header = b"\x0a\x03abc"
        if rng.random() < 0.5:
            header = mutate_bytes(rng, header, hot=len(header))
        hlen = len(header) if rng.random() < 0.85 else pick(rng, [0, 2 ** 63, 2 ** 40, len(header) + 5, 17 << 20])
        body = struct.pack("<Q", hlen % (1 << 64)) + header + b"".join(t["data"] for t in ins + outs)
        if rng.random() < 0.3:
            body = mutate_bytes(rng, body, hot=16)
        files.append((f"20240301120000/0/model/1/0/{W.dump_name('MatMul', f'op{k}', k + 1, 0, 1700000000000000 + k)}",
                      body))
    return files


def _make_opdebug(rng: random.Random) -> Files:
    files = _make_cann(rng) if rng.random() < 0.7 else []
    if rng.random() < 0.5:
        rec = W.old_record({"AI Core": {"model_id": 1, "stream_id": 0, "task_id": 1, "task_type": 0,
                                        "status": rng.choice((0, 1 << 8, 0xFFFF, 2 ** 64 - 1))}})
    else:
        n = rng.randint(0, 12)
        rec = W.new_record(rng.choice((0, 1, 2, 3, 99)), [rng.randrange(2 ** 64) for _ in range(n)],
                           [rng.randrange(2 ** 64) for _ in range(rng.randint(0, 3))],
                           version=rng.choice((0, 1, 2 ** 31)), valid=rng.choice((0, 1, 2)),
                           data_len=rng.choice((None, 0, 2 ** 31, 2 ** 32 - 1, 7)))
    if rng.random() < 0.5:
        rec = mutate_bytes(rng, rec, hot=64)
    header = W.encode_dump_data([], [W.tensor(np.frombuffer(rec, dtype=np.uint8))], op_name="Node_OpDebug")
    body = struct.pack("<Q", len(header)) + header + rec
    if rng.random() < 0.3:
        body = mutate_bytes(rng, body, hot=len(body))
    files.append((f"20240301120000/0/model/1/0/{W.opdebug_name(1, 0, 1700000000000099)}", body))
    return files


def _make_mindspore(rng: random.Random) -> Files:
    files: Files = []
    base = "rank_0/net/0/1"
    for k in range(rng.randint(0, 2)):
        a = small_array(rng, pick(rng, ["float32", "float16"]))
        raw = npy_bytes(a)
        if rng.random() < 0.4:
            raw = mutate_bytes(rng, _npy_header_edit(rng, raw), hot=128)
        files.append((f"{base}/MatMul.Default_op{k}.{k}.{k}.1700000000{k}.output.0.DefaultFormat.npy", raw))
    rows = ["Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,Data Type,Shape,Max Value,"
            "Min Value,Avg Value,Count,Negative Zero Count,Positive Zero Count,NaN Count,"
            "Negative Inf Count,Positive Inf Count,Zero Count"]
    for k in range(rng.randint(0, 4)):
        rows.append(f"MatMul,Default/op{k},{k},0,17000000{k},output,0,16,float32,\"(2,2)\",1.5,-1.5,0.1,4,0,0,"
                    f"{rng.choice((0, 1, 'nan', -1, 10 ** 30))},0,0,0")
    text = "\n".join(rows) + "\n"
    if rng.random() < 0.7:
        from .mutate import mutate_text
        text = mutate_text(rng, text, ["nan", ",", '"', "(1,2", "inf", "\x00", "1e999", "-0", "\r\n"], 1 << 16)
    files.append((f"{base}/statistic.csv", text.encode("utf-8", "surrogatepass")))
    return files


def _scan(files: Files, work: Path) -> None:
    for rel, raw in files:
        p = work / "dump" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(raw)
    result = scan_dump(work / "dump")
    json.dumps(result, default=str)  # what `scan --json` prints
    result_samples(result, {"job": "fuzz"})


def _make_msprobe_pair(rng: random.Random) -> Files:
    """Two damaged msprobe trees, ``bench`` and ``target`` (the same files one time in three):
    what ``compare`` reads, its path without numpy (torchzip.open_pt_raw, compare_raw) first."""
    a = _make_msprobe(rng)
    b = a if rng.random() < 0.3 else _make_msprobe(rng)
    return [(f"bench/{rel}", raw) for rel, raw in a] + [(f"target/{rel}", raw) for rel, raw in b]


def _compare(files: Files, work: Path) -> None:
    for rel, raw in files:
        p = work / "dump" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(raw)
    res = compare_paths(str(work / "dump" / "bench"), str(work / "dump" / "target"), jobs=2)
    json.dumps(json_safe(to_json(res)))   # what `compare --json` prints
    format_text(res)


def _make_protobuf(rng: random.Random) -> bytes:
    if rng.random() < 0.2:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    ins = [W.tensor(small_array(rng, "float32")) for _ in range(rng.randint(0, 2))]
    raw = W.encode_dump_data(ins, [W.tensor(small_array(rng, "float16"))], op_name=pick(rng, ["a", "b" * 300]))
    return mutate_bytes(rng, raw, hot=len(raw))


def _run_protobuf(raw: bytes, work: Path) -> None:
    decode_dump_data(raw)


TARGETS = [
    Target("dump_npy", _make_npy, _scan),
    Target("dump_msprobe", _make_msprobe, _scan),
    Target("compare_msprobe", _make_msprobe_pair, _compare),
    Target("dump_cann", _make_cann, _scan),
    Target("dump_opdebug", _make_opdebug, _scan),
    Target("dump_mindspore", _make_mindspore, _scan),
    Target("protobuf", _make_protobuf, _run_protobuf, (DumpError,)),
]

