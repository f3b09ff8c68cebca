"""torch.save files and msprobe .pt dumps, written byte for byte without torch (protocol-2 pickles in a zip)."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import numpy as np


_STORAGE = {"float32": "FloatStorage", "float16": "HalfStorage", "float64": "DoubleStorage",
            "int64": "LongStorage", "bool": "BoolStorage", "bfloat16": "BFloat16Storage"}


def _u(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _i(v: int) -> bytes:
    return b"J" + struct.pack("<i", v)


def _tup(vals) -> bytes:
    return b"(" + b"".join(_i(v) for v in vals) + b"t"


def tensor_pickle(storage: str, numel: int, size, stride, offset: int = 0, key: str = "0") -> bytes:
    """data.pkl exactly as torch.save writes it for one tensor (protocol 2, see the corpus)."""
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((" + _u("storage")
            + f"ctorch\n{storage}\n".encode() + _u(key) + _u("cpu") + _i(numel) + b"tQ"
            + _i(offset) + _tup(size) + _tup(stride) + b"\x89ccollections\nOrderedDict\n)Rt" + b"R.")


def write_pt_raw(path: Path, pkl: bytes, storage_bytes: bytes | None = b"",
                 compress: int = zipfile.ZIP_STORED, align: int = 0) -> Path:
    """``align``: the storage's data starts at a multiple of it in the file, as torch places it
    (padding in an "FB" extra field of the local header); 0: wherever the zip puts it."""
    stem = path.name.removesuffix(".pt")
    with zipfile.ZipFile(path, "w", compression=compress) as z:
        z.writestr(f"{stem}/data.pkl", pkl)
        z.writestr(f"{stem}/.format_version", "1")
        z.writestr(f"{stem}/.storage_alignment", "64")
        z.writestr(f"{stem}/byteorder", "little")
        if storage_bytes is not None:
            name = f"{stem}/data/0"
            if align and compress == zipfile.ZIP_STORED:
                assert z.fp is not None
                pad = -(z.fp.tell() + 30 + len(name.encode()) + 4) % align
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
                z.writestr(info, storage_bytes)
            else:
                z.writestr(name, storage_bytes)
        z.writestr(f"{stem}/version", "3\n")
    return path


def write_pt(path: Path, arr: np.ndarray, dtype: str | None = None, transpose: bool = False,
             align: int = 0) -> Path:
    """torch.save of ``arr`` (bf16: pass uint16 words and dtype="bfloat16"). ``transpose`` stores
    arr.T's storage and describes ``arr`` as a strided view of it. ``align``: as write_pt_raw."""
    dtype = dtype or arr.dtype.name
    if transpose:
        base = np.ascontiguousarray(arr.T)
        stride = tuple(reversed([s // arr.itemsize for s in base.strides]))
        raw = base.tobytes()
    else:
        c = arr.copy(order="C")
        raw = c.tobytes()
        stride = tuple(s // arr.itemsize for s in c.strides)
    pkl = tensor_pickle(_STORAGE[dtype], arr.size, arr.shape, stride)
    return write_pt_raw(path, pkl, raw, align=align)


def item(arr: np.ndarray, data_name: str | None) -> dict:
    a = arr.astype(np.float64)
    d = {"type": "torch.Tensor", "dtype": f"torch.{arr.dtype.name}", "shape": list(arr.shape),
         "Max": float(a.max()), "Min": float(a.min()), "Mean": float(a.mean()),
         "Norm": float(np.sqrt((a * a).sum())), "requires_grad": False}
    if data_name:
        d["data_name"] = data_name
    return d


def write_msprobe_pt(rank_dir: Path, entries: dict, tensor_mode: bool = True, align: int = 0) -> Path:
    """entries: {key: {slot: [array | None | {"type":..,"value":..}]}} -> a dump dir (``align``:
    each storage's data at a multiple of it, as torch writes them)."""
    data_dir = rank_dir / "dump_tensor_data"
    data_dir.mkdir(parents=True)
    data = {}
    for key, slots in entries.items():
        data[key] = {}
        for slot, values in slots.items():
            out = []
            for i, v in enumerate(values):
                if isinstance(v, np.ndarray):
                    io_ = "input" if slot.startswith("input") else "output"
                    name = f"{key}.{io_}.{i}.pt" if tensor_mode else None
                    if name:
                        write_pt(data_dir / name, v, align=align)
                    out.append(item(v, name))
                else:
                    out.append(v)
            data[key][slot] = out
    doc = {"task": "tensor" if tensor_mode else "statistics", "level": "L1",
           "framework": "pytorch", "dump_data_dir": None, "data": data}
    (rank_dir / "dump.json").write_text(json.dumps(doc))  # writes bare Infinity/NaN like msprobe
    return rank_dir
