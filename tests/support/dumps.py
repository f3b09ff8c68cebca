"""Test-only writers for byte-exact CANN dump files and Opdebug records (never used by the agent).

The protobuf encoder here is deliberately independent of agent/dumps/protobuf.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import os
import struct
from typing import Any, Sequence

import numpy as np

DT = {"float32": 1, "float16": 2, "int8": 3, "uint8": 4, "int16": 5, "uint16": 6, "int32": 7,
      "int64": 8, "uint32": 9, "uint64": 10, "bool": 11, "float64": 12, "bfloat16": 27}
FMT = {"NCHW": 0, "NHWC": 1, "ND": 2, "NC1HWC0": 3, "FRACTAL_Z": 4, "FRACTAL_NZ": 29}


def varint(v: int) -> bytes:
    if v < 0:
        v += 1 << 64
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def f_varint(field: int, v: int) -> bytes:
    return key(field, 0) + varint(v)


def f_bytes(field: int, data: bytes) -> bytes:
    return key(field, 2) + varint(len(data)) + data


def f_str(field: int, s: str) -> bytes:
    return f_bytes(field, s.encode())


def shape_msg(dims: Sequence[int], packed: bool = True) -> bytes:
    if packed:
        return f_bytes(1, b"".join(varint(d) for d in dims)) if dims else b""
    return b"".join(f_varint(1, d) for d in dims)


def tensor(array: np.ndarray, dtype: str | None = None, fmt: str = "ND",
           shape: Sequence[int] | None = None, original_shape: Sequence[int] | None = None,
           size: int | None = None, dtype_code: int | None = None) -> dict[str, Any]:
    """A tensor spec for :func:`write_cann_dump`; ``dtype="bfloat16"`` takes uint16 words."""
    arr = np.array(array, order="C", copy=True)
    name = dtype or arr.dtype.name
    return {"data": arr.astype(arr.dtype.newbyteorder("<")).tobytes(),
            "dtype_code": DT[name] if dtype_code is None else dtype_code, "format": FMT[fmt],
            "shape": list(arr.shape if shape is None else shape),
            "original_shape": original_shape, "size": size}


def _tensor_msg(t: dict[str, Any], is_input: bool) -> bytes:
    shape_f, size_f, orig_f = (3, 5, 6) if is_input else (3, 6, 7)
    body = f_varint(1, t["dtype_code"]) + f_varint(2, t["format"])
    body += f_bytes(shape_f, shape_msg(t["shape"], packed=t.get("packed", True)))
    body += f_varint(size_f, len(t["data"]) if t["size"] is None else t["size"])
    if t["original_shape"] is not None:
        body += f_bytes(orig_f, shape_msg(t["original_shape"]))
    if not is_input:
        body += f_varint(8, -1)   # sub_format as a negative int32 (10-byte varint)
    return body


def encode_dump_data(inputs: Sequence[dict], outputs: Sequence[dict], op_name: str = "",
                     buffers: Sequence[bytes] = (), version: str = "2.0") -> bytes:
    msg = f_str(1, version) + f_varint(2, 1673383728093446)
    for t in outputs:
        msg += f_bytes(3, _tensor_msg(t, False))
    for t in inputs:
        msg += f_bytes(4, _tensor_msg(t, True))
    for b in buffers:
        msg += f_bytes(5, f_varint(1, 0) + f_varint(3, len(b)))
    if op_name:
        msg += f_str(6, op_name)
    msg += f_bytes(7, f_str(1, "attr") + f_str(2, "value"))
    return msg


def write_cann_dump(path: str, inputs: Sequence[dict] = (), outputs: Sequence[dict] = (),
                    op_name: str = "", buffers: Sequence[bytes] = (),
                    header: bytes | None = None) -> str:
    """Write ``[u64 header_len][DumpData][inputs][outputs][buffers]``; returns ``path``."""
    if header is None:
        header = encode_dump_data(inputs, outputs, op_name, buffers)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        for t in list(inputs) + list(outputs):
            fh.write(t["data"])
        for b in buffers:
            fh.write(b)
    return path


def dump_name(op_type: str, op_name: str, task: int, stream: int | None, ts: int,
              ffts: Sequence[int] = ()) -> str:
    parts = [op_type, op_name, str(task)] + ([str(stream)] if stream is not None else [])
    return ".".join(parts + [str(ts)] + [str(x) for x in ffts])


# --- Opdebug records --------------------------------------------------------------------------
_INFO_AT = {"DHA Atomic Add": 0, "L2 Atomic Add": 128, "AI Core": 256}
_STATUS_AT = {"DHA Atomic Add": 512, "L2 Atomic Add": 768, "AI Core": 1024 + 16}
U64_MAX = (1 << 64) - 1


def old_record(units: dict[str, dict[str, int]]) -> bytes:
    """The 2048-byte record; ``units`` maps "AI Core"/"DHA Atomic Add"/"L2 Atomic Add" to
    {model_id, stream_id, task_id, task_type, status, [kernel_code, block_idx]}."""
    buf = bytearray(2048)
    for unit, f in units.items():
        ids = [f.get(k, 0) for k in ("model_id", "stream_id", "task_id", "task_type")]
        ids = [U64_MAX if v == -1 else v for v in ids]
        struct.pack_into("<6Q", buf, _INFO_AT[unit], *ids, 0x1000, 0x2000)
        struct.pack_into("<Q", buf, _STATUS_AT[unit], f["status"])
        if unit == "AI Core":
            struct.pack_into("<2Q", buf, 1024, f.get("kernel_code", 0xABC), f.get("block_idx", 3))
    return bytes(buf)


def new_record(acc_type: int, fields: Sequence[int], status: Sequence[int], version: int = 0,
               valid: int = 1, data_len: int | None = None) -> bytes:
    """The 0x5A5A5A5A record: magic, version, acc_list{valid, acc_type, rsv, data_len, data}."""
    data = struct.pack(f"<{len(fields) + len(status)}Q", *fields, *status)
    dl = len(data) if data_len is None else data_len
    return struct.pack("<6I", 0x5A5A5A5A, version, valid, acc_type, 0, dl) + data


def write_opdebug(path: str, record: bytes) -> str:
    """An Opdebug dump file whose output[0] (uint8) is ``record``."""
    rec = tensor(np.frombuffer(record, dtype=np.uint8))
    return write_cann_dump(path, outputs=[rec], op_name="Node_OpDebug")


def opdebug_name(task: int, stream: int, ts: int) -> str:
    return f"Opdebug.Node_OpDebug.{task}.{stream}.{ts}"


def ensure_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def write_ops(directory: str, ops: Sequence[tuple], ts0: int, stream: int = 0) -> list[str]:
    """One dump file per ``(op_type, op_name, task_id, inputs, outputs)`` (numpy arrays), in
    execution order: timestamps ``ts0``, ``ts0 + 1``, ...; returns the paths."""
    ensure_dir(directory)
    paths = []
    for i, (op_type, name, task, ins, outs) in enumerate(ops):
        p = os.path.join(directory, dump_name(op_type, name, task, stream, ts0 + i))
        paths.append(write_cann_dump(p, inputs=[tensor(a) for a in ins], outputs=[tensor(a) for a in outs]))
    return paths


def ge_step_dir(root: str, device: int, step: int, time_dir: str = "20240301120000") -> str:
    """The GE/ACL dump directory ``{root}/{time}/{device_id}/{model_name}/{model_id}/{step}``."""
    return ensure_dir(os.path.join(root, time_dir, str(device), "ge_default_20240301120001_1", "1", str(step)))


def msprobe_item(arr: np.ndarray, data_name: str | None) -> dict:
    a = arr.astype(np.float64)
    item = {"type": "torch.Tensor", "dtype": f"torch.{arr.dtype.name}", "shape": list(arr.shape),
            "Max": float(a.max()), "Min": float(a.min()), "Mean": float(a.mean()),
            "Norm": float(np.linalg.norm(a)), "requires_grad": False}
    if data_name:
        item["data_name"] = data_name
    return item


def write_msprobe(root: Path, entries: list[tuple[str, dict[str, list[np.ndarray]]]], step: int = 0,
                  rank: str = "rank0", task: str = "tensor") -> Path:
    """An msprobe dump dir ``root/step<N>/<rank>/`` with dump.json and .npy tensor files.

    ``entries``: (key, {slot: [arrays]}) in execution order; slots as in dump.json
    (input_args, output, input, parameters as a list here, named weight/bias)."""
    d = root / f"step{step}" / rank
    (d / "dump_tensor_data").mkdir(parents=True, exist_ok=True)
    data: dict[str, dict] = {}
    for key, slots in entries:
        entry: dict = {}
        for slot, arrays in slots.items():
            kind = "input" if slot.startswith("input") else slot
            items = []
            for i, arr in enumerate(arrays):
                label = ("weight", "bias")[i] if slot == "parameters" else str(i)
                name = f"{key}.{kind}.{label}.npy" if task == "tensor" else None
                if name:
                    np.save(d / "dump_tensor_data" / name, arr)
                items.append((label, msprobe_item(arr, name)))
            entry[slot] = dict(items) if slot == "parameters" else [it for _, it in items]
        data[key] = entry
    doc = {"task": task, "level": "L1", "framework": "pytorch", "dump_data_dir": None, "data": data}
    (d / "dump.json").write_text(json.dumps(doc))
    return d


RNG = np.random.default_rng(7)


X = RNG.standard_normal((8, 16)).astype(np.float32)


W1 = (RNG.standard_normal((32, 16)) * 0.2).astype(np.float32)


W2 = (RNG.standard_normal((16, 32)) * 0.2).astype(np.float32)


def _linear(x, w, half=False):
    if half:
        return (x.astype(np.float16) @ w.T.astype(np.float16)).astype(np.float32)
    return x @ w.T


def tiny_net(root, *, half_fc2=False, w2=W2, step=0, task="tensor", bump=None):
    """relu(x W1ᵀ) W2ᵀ then tanh, as three msprobe entries (plus a backward entry of tanh)."""
    h = _linear(X, W1)
    r = np.maximum(h, 0)
    y = _linear(r, w2, half=half_fc2)
    out = np.tanh(y)
    if bump is not None:              # a one-ulp change in the final output (a nondeterministic sum)
        out = out.copy()
        out.flat[bump] = np.nextafter(out.flat[bump], np.float32(np.inf))
    grad = np.ones_like(out)
    entries = [("Functional.linear.0.forward", {"input_args": [X, W1], "output": [h]}),
               ("Torch.relu.0.forward", {"input_args": [h], "output": [r]}),
               ("Functional.linear.1.forward", {"input_args": [r, w2], "output": [y]}),
               ("Torch.tanh.0.forward", {"input_args": [y], "output": [out]}),
               ("Torch.tanh.0.backward", {"input": [grad], "output": [grad * (1 - out * out)]})]
    return write_msprobe(root, entries, step=step, task=task)


def _q(s: str) -> str:
    """C-escape a string as protobuf's text printer does for bytes fields (octal for non-ASCII)."""
    out = []
    for b in s.encode("utf-8"):
        c = chr(b)
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif 32 <= b < 127:
            out.append(c)
        else:
            out.append(f"\\{b:03o}")
    return '"' + "".join(out) + '"'


def _attr(key: str, value: object, ind: str) -> str:
    if isinstance(value, list):
        items = "".join(f"{ind}      s: {_q(v)}\n" for v in value)
        body = f"{ind}    list {{\n{items}{ind}      val_type: VT_LIST_STRING\n{ind}    }}\n"
    elif isinstance(value, bool):
        body = f"{ind}    b: {'true' if value else 'false'}\n"
    elif isinstance(value, int):
        body = f"{ind}    i: {value}\n"
    else:
        body = f"{ind}    s: {_q(value)}\n"
    return f"{ind}attr {{\n{ind}  key: {_q(key)}\n{ind}  value {{\n{body}{ind}  }}\n{ind}}}\n"


def ge_text(graphs: list[tuple[str, list[dict]]], model: str = "ge_default_model") -> str:
    lines = [f"name: {_q(model)}\nversion: 2\n", _attr("run_count", 3, "")]
    for gname, ops in graphs:
        lines.append(f"graph {{\n  name: {_q(gname)}\n  input: \"x:0\"\n")
        for op in ops:
            lines.append(f"  op {{\n    name: {_q(op['name'])}\n    type: {_q(op['type'])}\n    id: 7\n")
            for inp in op.get("inputs", []):
                lines.append(f"    input: {_q(inp)}\n")
            for k, v in op.get("attrs", {}).items():
                lines.append(_attr(k, v, "    "))
            lines.append("    input_desc {\n      dtype: DT_FLOAT16\n      shape {\n        dim: 8\n      }\n"
                         "      layout: \"ND\"\n    }\n")
            for out in op.get("outputs", []):
                lines.append("    output_desc {\n      name: \"\"\n      dtype: DT_FLOAT\n"
                             "      shape {\n        dim: 8\n        dim: -1\n      }\n      layout: \"NCHW\"\n")
                for k, v in out.items():
                    lines.append(_attr(k, v, "      "))
                lines.append("      has_out_attr: true\n    }\n")
            lines.append("  }\n")
        lines.append("}\n")
    return "".join(lines)


OPDEBUG_TS = 1_709_294_400_000_000   # a CANN dump timestamp (µs)
ONE = np.ones((2, 3), np.float16)
INF = np.array([1.0, np.inf, 2.0], np.float16)


def opdebug_two_ranks_two_steps(root):
    """Device 0: step 0 clean, step 1 Add overflows (Inf from finite inputs); device 1: step 1
    clean. Opdebug files in device 0 step 1 name the Add (AI Core) and a Cast (DHA atomic add)."""
    for dev in (0, 1):
        for step in (0, 1):
            bad = dev == 0 and step == 1
            write_ops(ge_step_dir(str(root), dev, step), [
                ("MatMul", "mm", 10, [ONE, ONE], [ONE]),
                ("Add", "add", 11, [ONE], [INF if bad else ONE]),
                ("Cast", "cast", 12, [INF if bad else ONE], [ONE]),
            ], OPDEBUG_TS + 1000 * step)
    d = ge_step_dir(str(root), 0, 1)
    # the later overflow sorts first by name ("10" < "9") and must come second
    write_opdebug(f"{d}/{opdebug_name(10, 0, OPDEBUG_TS + 1000 + 50)}", old_record(
        {"DHA Atomic Add": {"stream_id": 0, "task_id": 12, "status": 0x0A00}}))
    write_opdebug(f"{d}/{opdebug_name(9, 0, OPDEBUG_TS + 1000 + 5)}", new_record(
        0, [1, 0, 11, 0, 65535, 65535, 0, 0, 0, 0], [0x20]))
    return d
