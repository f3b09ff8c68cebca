"""Read msprobe (mindstudio-probe) dump directories: ``step<N>/rank<R>|proc<PID>/dump.json``.

Each entry of ``dump.json``'s ``data`` (in file order, which is execution order) yields one
``DumpTensor`` per tensor item, in the order the entry lists them: ``input_args``,
``input_kwargs``, ``input`` (backward grads in), ``output``, ``parameters``; a
``parameters_grad`` entry is ``{name: [item]}`` itself.

- ``name`` is the entry key (``Functional.linear.7.forward``), ``order`` the entry's position
  in ``data`` (all tensors of one call share it), ``index`` the item's position in its list or
  dict, ``io`` is ``input`` / ``output`` / ``param``.
- ``extra``: ``slot`` (the dump.json field), ``arg`` (msprobe's suffix for the item, e.g. ``2``,
  ``alpha``, ``weight``, ``weight.0``, ``1.0`` for a tensor nested in a list arg), ``entry``
  (same as order), ``data_name`` (tensor mode), ``stats_counts`` = ``"lower_bound"``, ``pid``
  (for a ``proc<PID>`` dir, whose ``rank`` is None; ``step``/``rank`` come from the dir names).
- ``stats`` come from Max/Min/Mean/Norm. dump.json has no element counts, so the NaN/Inf counts
  are lower bounds derived from Max/Min (which are non-finite exactly when the tensor has a NaN
  or Inf element): Max=+inf -> pos_inf>=1, Min=-inf -> neg_inf>=1, NaN in Max/Min -> nan>=1,
  Max=-inf -> every element -inf, Min=+inf -> every element +inf.
- ``load`` (task ``tensor``) reads ``dump_tensor_data/<data_name>`` next to dump.json (``.pt`` via
  :mod:`.torchzip`, ``.npy`` via :mod:`.npy`), never the absolute ``dump_data_dir``; it checks
  the shape against dump.json. Statistics mode: ``load`` is None.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from ..model import TensorStats
from .npy import read_npy
from .torchzip import inspect_pt, open_pt, open_pt_raw, pt_region, raw_may_take
from ..safeio import open_regular_file
from .types import DumpError, DumpTensor, FileRegion, RawTensor, ZipRegion

MAX_DUMP_JSON = 512 << 20
MAX_DIMS = 64
_STEP = re.compile(r"step(\d+)")
_RANK = re.compile(r"rank(\d*)|proc(\d+)")
_DATA_NAME = re.compile(r"[A-Za-z0-9_.\-]+\.(pt|npy)")
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "long": "int64",
                  "int": "int32", "short": "int16", "cfloat": "complex64", "cdouble": "complex128"}
_SLOTS_IO = (("input_args", "input"), ("input_kwargs", "input"), ("input", "input"),
             ("output", "output"), ("parameters", "param"))


def normalize_dtype(value: str) -> str:
    name = value.rsplit(".", 1)[-1] if value.startswith(("torch.", "mindspore.", "numpy.")) else value
    name = name.lower()
    return _DTYPE_ALIASES.get(name, name)


_FLOAT_MAX_INT = int(sys.float_info.max)


def _stat(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, float):
        return value
    if isinstance(value, int):   # JSON integers are unbounded: one past float's range says nothing
        return float(value) if abs(value) <= _FLOAT_MAX_INT else None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _is_tensor(item: Any) -> bool:
    return (isinstance(item, dict) and "dtype" in item and "shape" in item
            and str(item.get("type", "")).endswith(("Tensor", "ndarray", "Parameter")))


def _iter_items(value: Any, label: str) -> Iterator[tuple[str, dict]]:
    """Tensor items inside an argument, depth-first, with msprobe's dotted suffix."""
    if _is_tensor(value):
        yield label, value
    elif isinstance(value, (list, tuple)):
        for i, sub in enumerate(value):
            yield from _iter_items(sub, f"{label}.{i}")
    # non-tensor {type, value} items and null grads take their position and yield nothing


def _entry_items(entry: dict, key: str) -> Iterator[tuple[str, str, int, str, dict]]:
    """(slot, io, index, arg label, item) for one dump.json entry."""
    if ".parameters_grad." in key:
        for index, (pname, items) in enumerate(entry.items()):
            for arg, item in _iter_items(items, str(pname)):
                yield "parameters_grad", "param", index, arg, item
        return
    for slot, io in _SLOTS_IO:
        value = entry.get(slot)
        if value is None:
            continue
        if isinstance(value, dict):
            pairs = enumerate(value.items())
            for index, (argname, sub) in pairs:
                for arg, item in _iter_items(sub, str(argname)):
                    yield slot, io, index, arg, item
        elif isinstance(value, list):
            for index, sub in enumerate(value):
                for arg, item in _iter_items(sub, str(index)):
                    yield slot, io, index, arg, item
        else:
            raise DumpError(f"entry {key}: field {slot} is {type(value).__name__}, not a list or dict")


def _stats_from_item(item: dict, name: str, io: str, index: int, dtype: str,
                     shape: tuple[int, ...], step, rank, path: str) -> TensorStats | None:
    mx, mn, mean, norm = (_stat(item.get(k)) for k in ("Max", "Min", "Mean", "Norm"))
    if mx is None and mn is None and mean is None and norm is None:
        return None
    count = math.prod(shape)
    nan = pos = neg = 0
    for v in (mx, mn):
        if v is not None and math.isnan(v):
            nan = 1
    if mx == math.inf:
        pos = 1
    if mn == -math.inf:
        neg = 1
    if mx == -math.inf:
        neg = count
    if mn == math.inf:
        pos = count
    return TensorStats(name=name, io=io, index=index, dtype=dtype, shape=shape, count=count,
                       nan=nan, pos_inf=pos, neg_inf=neg, min=mn, max=mx, mean=mean, l2norm=norm,
                       step=step, rank=rank, path=path)


def _loader(path: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        if path.endswith(".pt"):
            arr = open_pt(path)
        else:
            arr = read_npy(path).load()  # type: ignore[misc]
        if tuple(arr.shape) != shape:
            raise DumpError(f"{path}: tensor shape {tuple(arr.shape)} != dump.json shape {shape}")
        return arr
    return load


def _raw(path: str, shape: tuple[int, ...], dtype: str) -> Callable[[], RawTensor | None]:
    """The .pt's words for the compare's C kernel (None: ``load`` reads it, or says what is wrong),
    taken as bfloat16 exactly where the dump declares it, as ``load``'s array is read."""
    bf16 = dtype == "bfloat16"

    def raw() -> RawTensor | None:
        got = open_pt_raw(path)
        return got if got is not None and tuple(got.shape) == shape and (got.code == "bf16") == bf16 else None
    return raw


def _region(path: str, shape: tuple[int, ...]) -> Callable[[], FileRegion | ZipRegion | None]:
    def region() -> FileRegion | ZipRegion | None:
        if path.endswith(".pt"):
            reg = pt_region(inspect_pt(path))
        else:
            reg = read_npy(path).region()  # type: ignore[misc]
        if reg is not None and tuple(reg.shape) != shape:
            raise DumpError(f"{path}: tensor shape {tuple(reg.shape)} != dump.json shape {shape}")
        return reg
    return region


def _dir_number(name: str, pattern: re.Pattern) -> int | None:
    m = pattern.fullmatch(name)
    if not m:
        return None
    digits = next((g for g in m.groups() if g), "")
    return int(digits) if digits else None


def load_dump_json(path: Path, max_bytes: int = MAX_DUMP_JSON) -> dict:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise DumpError(f"{path}: {size} bytes exceeds the {max_bytes}-byte limit for dump.json")
        with open_regular_file(path) as fh:
            doc = json.loads(fh.read(max_bytes + 1))
    except DumpError:
        raise
    except OSError as exc:
        raise DumpError(f"{path}: cannot read: {exc}") from None
    except RecursionError:
        raise DumpError(f"{path}: JSON nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DumpError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise DumpError(f"{path}: not an msprobe dump.json (no 'data' object)")
    return doc


def read_msprobe_rank_dir(rank_dir: str | os.PathLike, *,
                          max_json: int = MAX_DUMP_JSON) -> list[DumpTensor]:
    rank_dir = Path(rank_dir)
    doc = load_dump_json(rank_dir / "dump.json", max_json)
    task = doc.get("task", "")
    tensor_mode = task == "tensor"
    step = _dir_number(rank_dir.parent.name, _STEP)
    m = _RANK.fullmatch(rank_dir.name)
    rank = int(m.group(1)) if m and m.group(1) else None   # proc<PID>: not a rank
    pid = int(m.group(2)) if m and m.group(2) else None
    data_dir = os.path.join(rank_dir, "dump_tensor_data")   # strings: a Path per tensor cost more than its read
    json_path = os.path.join(rank_dir, "dump.json")
    out: list[DumpTensor] = []
    for order, (key, entry) in enumerate(doc["data"].items()):
        if not isinstance(entry, dict):
            raise DumpError(f"{rank_dir}/dump.json: entry {key!r} is not an object"[:300])
        op_type = _op_type(key)
        for slot, io, index, arg, item in _entry_items(entry, key):
            t = _tensor(item, key, slot, io, index, arg, order, step, rank, op_type,
                        json_path, data_dir, tensor_mode)
            if pid is not None:
                t.extra["pid"] = pid
            out.append(t)
    return out


def _op_type(key: str) -> str:
    parts = key.split(".")
    if parts[0] == "Module":
        m = re.search(r"\.([^.]+)\.(?:forward|backward|parameters_grad)\.\d+$", key)
        return f"Module.{m.group(1)}" if m else "Module"
    return ".".join(parts[:2])


def _tensor(item: dict, key: str, slot: str, io: str, index: int, arg: str, order: int,
            step, rank, op_type: str, json_path: str, data_dir: str, tensor_mode: bool) -> DumpTensor:
    dtype_raw, shape_raw = item.get("dtype"), item.get("shape")
    if not isinstance(dtype_raw, str) or not isinstance(shape_raw, list) or len(shape_raw) > MAX_DIMS \
            or not all(type(d) is int and d >= 0 for d in shape_raw):
        raise DumpError(f"{json_path}: {key} {slot} {arg}: bad dtype/shape {dtype_raw!r}/{shape_raw!r}"[:300])
    dtype, shape = normalize_dtype(dtype_raw), tuple(shape_raw)
    extra: dict = {"slot": slot, "arg": arg, "entry": order, "stats_counts": "lower_bound"}
    load = region = raw = None
    path = json_path
    data_name = item.get("data_name")
    if tensor_mode and data_name is not None:
        if not isinstance(data_name, str) or not _DATA_NAME.fullmatch(data_name) or ".." in data_name:
            raise DumpError(f"{json_path}: {key} {slot} {arg}: unsafe data_name {data_name!r}"[:300])
        extra["data_name"] = data_name
        path = os.path.join(data_dir, data_name)
        load, region = _loader(path, shape), _region(path, shape)
        raw = _raw(path, shape, dtype) if data_name.endswith(".pt") and raw_may_take(dtype, shape) else None
    stats = _stats_from_item(item, key, io, index, dtype, shape, step, rank, path)
    return DumpTensor(name=key, io=io, index=index, dtype=dtype, shape=shape, order=order,
                      step=step, rank=rank, path=path, op_type=op_type, load=load, stats=stats,
                      extra=extra, region=region, raw=raw)


def find_rank_dirs(root: str | os.PathLike) -> list[Path]:
    """rank/proc dirs under a dump root, a step dir, or the rank dir itself, in (step, rank) order."""
    root = Path(root)
    if (root / "dump.json").is_file():
        return [root]

    def ranks(step_dir: Path) -> list[Path]:
        found = [p for p in step_dir.iterdir() if p.is_dir() and _RANK.fullmatch(p.name)
                 and (p / "dump.json").is_file()]
        return sorted(found, key=lambda p: (_dir_number(p.name, _RANK) or 0, p.name))

    if _STEP.fullmatch(root.name):
        return ranks(root)
    if not root.is_dir():
        raise DumpError(f"{root}: not a directory")
    steps = sorted((p for p in root.iterdir() if p.is_dir() and _STEP.fullmatch(p.name)),
                   key=lambda p: _dir_number(p.name, _STEP) or 0)
    return [r for s in steps for r in ranks(s)]


def list_msprobe_dump(root: str | os.PathLike) -> list[DumpTensor]:
    out: list[DumpTensor] = []
    for rank_dir in find_rank_dirs(root):
        out.extend(read_msprobe_rank_dir(rank_dir))
    return out


def inf_extremes(mx: float | None, mn: float | None, pos_inf: int, neg_inf: int,
                 ) -> tuple[float | None, float | None]:
    """(max, min) as msprobe writes them: +Inf when an element is +Inf (-Inf likewise), the
    finite extreme otherwise; a tensor of only +Inf has min +Inf too. NaN elements are left out
    (they are counted apart): a tensor of only NaN has neither."""
    if pos_inf:
        mx = math.inf
        mn = mn if mn is not None else (-math.inf if neg_inf else math.inf)
    if neg_inf:
        mn = -math.inf
        mx = math.inf if pos_inf else (mx if mx is not None else -math.inf)
    return mx, mn
