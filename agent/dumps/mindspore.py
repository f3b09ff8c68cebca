"""MindSpore (Ascend O0/O1) tensor dumps: per-tensor ``.npy`` files and ``statistic.csv``.

Layout (reference/ascend-formats.md §2.2): ``{path}/rank_{rank}/{net}/{graph_id}/{iteration}/``
holding ``{op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}.{input|output}.{slot}.{format}
[.{dtype}].npy`` (MindSpore 2.4 adds the dtype; older versions do not) and/or ``statistic.csv``
with columns ``Op Type, Op Name, Task ID, Stream ID, Timestamp, IO, Slot, Data Size, Data Type,
Shape`` followed by the chosen statistics. Op names have ``.``, ``/`` and spaces replaced by
``_``, so names split on ``.``.

Untested against real MindSpore output: no MindSpore dump is in the corpus. Statistic column
names are matched loosely (case-insensitive, "max"/"max value", "nan count", "l2norm", ...).
Execution order is (timestamp, task id, inputs before outputs, slot); ``name`` is the op name.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from pathlib import Path

from ..model import TensorStats
from .npy import read_npy
from ..safeio import open_regular_file
from .types import DumpError, DumpTensor

NPY_NAME = re.compile(
    r"(?P<op_type>[A-Za-z0-9_\-]+)\.(?P<op_name>[A-Za-z0-9_\-]+)\.(?P<task>\d+)\.(?P<stream>\d+)"
    r"\.(?P<ts>\d+)\.(?P<io>input|output)\.(?P<slot>\d+)\.(?P<format>[A-Za-z0-9_]+)"
    r"(?:\.(?P<dtype>[A-Za-z0-9_]+))?\.npy")
MAX_CSV = 256 << 20
_ITER = re.compile(r"\d+")
_RANK = re.compile(r"rank_(\d+)")


def parse_npy_name(name: str) -> dict | None:
    m = NPY_NAME.fullmatch(name)
    return m.groupdict() if m else None


def _location(directory: Path) -> tuple[int | None, int | None]:
    """(step, rank) from ``rank_{r}/{net}/{graph}/{iteration}``, when the path has that shape."""
    step = int(directory.name) if _ITER.fullmatch(directory.name) else None
    rank = None
    for part in directory.parts[::-1]:
        m = _RANK.fullmatch(part)
        if m:
            rank = int(m.group(1))
            break
    return step, rank


def read_mindspore_npy_dir(directory: str | os.PathLike) -> list[DumpTensor]:
    """Every dump ``.npy`` in one iteration directory, in execution order. Files whose names
    do not match the MindSpore pattern are ignored."""
    directory = Path(directory)
    step, rank = _location(directory)
    found = []
    for p in directory.iterdir():
        meta = parse_npy_name(p.name)
        if meta and p.is_file():
            found.append((int(meta["ts"]), int(meta["task"]), meta["io"] != "input",
                          int(meta["slot"]), p, meta))
    found.sort(key=lambda t: t[:4])
    out: list[DumpTensor] = []
    for order, (_, _, _, slot, p, meta) in enumerate(found):
        t = read_npy(p)
        extra = {"format": meta["format"], "task_id": int(meta["task"]),
                 "stream_id": int(meta["stream"]), "timestamp": int(meta["ts"]),
                 "file_dtype": meta["dtype"]}
        out.append(DumpTensor(name=meta["op_name"], io=meta["io"], index=slot, dtype=t.dtype,
                              shape=t.shape, order=order, step=step, rank=rank, path=str(p),
                              op_type=meta["op_type"], load=t.load, extra=extra,
                              region=t.region))
    return out


def _norm(col: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", col.lower()).strip()


_STAT_COLS = {"max": "max", "max value": "max", "min": "min", "min value": "min",
              "avg": "mean", "avg value": "mean", "mean": "mean", "l2norm": "l2norm",
              "l2norm value": "l2norm", "l2 norm": "l2norm", "nan count": "nan",
              "negative inf count": "neg_inf", "positive inf count": "pos_inf",
              "count": "count", "zero count": "zero"}


def _num(value: str) -> float | None:
    value = (value or "").strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _cnt(value: float | None) -> int:
    return int(value) if value is not None and math.isfinite(value) and value >= 0 else 0


def _shape(value: str, where: str) -> tuple[int, ...]:
    dims = re.findall(r"-?\d+", value or "")
    if len(dims) > 64 or any(d.startswith("-") for d in dims):
        raise DumpError(f"{where}: bad shape {value!r}"[:200])
    return tuple(int(d) for d in dims)


def read_statistic_csv(path: str | os.PathLike, max_bytes: int = MAX_CSV) -> list[DumpTensor]:
    """One statistics-only DumpTensor (``load`` None) per row, in file order."""
    path = Path(path)
    step, rank = _location(path.parent)
    try:
        if path.stat().st_size > max_bytes:
            raise DumpError(f"{path}: larger than {max_bytes} bytes")
        with open_regular_file(path, "r", encoding="utf-8", errors="strict") as fh:
            text = fh.read(max_bytes + 1)
    except DumpError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise DumpError(f"{path}: cannot read: {exc}") from None
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as exc:
        raise DumpError(f"{path}: bad CSV: {exc}") from None
    if not rows:
        return []
    header = [_norm(c) for c in rows[0]]
    need = ("op type", "op name", "io", "slot", "data type", "shape")
    missing = [c for c in need if c not in header]
    if missing:
        raise DumpError(f"{path}: not a MindSpore statistic.csv (missing columns {missing})")
    col = {c: i for i, c in enumerate(header)}
    out: list[DumpTensor] = []
    for lineno, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) < len(header):
            raise DumpError(f"{path}:{lineno}: {len(row)} fields, header has {len(header)}")
        get = lambda c: row[col[c]] if c in col else ""  # noqa: E731
        where = f"{path}:{lineno}"
        io_ = get("io").strip().lower()
        if io_ not in ("input", "output"):
            raise DumpError(f"{where}: IO is {get('io')!r}")
        try:
            slot = int(get("slot"))
        except ValueError:
            raise DumpError(f"{where}: slot is {get('slot')!r}") from None
        shape = _shape(get("shape"), where)
        dtype = get("data type").strip().lower()
        vals: dict[str, float | None] = {}
        for c, key in _STAT_COLS.items():
            if c in col:
                vals[key] = _num(get(c))
        count = vals.get("count")
        count = _cnt(count) if count is not None else math.prod(shape)
        zero = vals.get("zero")
        stats = TensorStats(
            name=get("op name"), io=io_, index=slot, dtype=dtype, shape=shape, count=count,
            nan=_cnt(vals.get("nan")), pos_inf=_cnt(vals.get("pos_inf")),
            neg_inf=_cnt(vals.get("neg_inf")), min=vals.get("min"), max=vals.get("max"),
            mean=vals.get("mean"), l2norm=vals.get("l2norm"),
            zero_fraction=(zero / count) if zero is not None and count else None,
            step=step, rank=rank, path=str(path))
        extra = {"line": lineno, "task_id": get("task id"), "stream_id": get("stream id"),
                 "timestamp": get("timestamp")}
        out.append(DumpTensor(name=get("op name"), io=io_, index=slot, dtype=dtype, shape=shape,
                              order=len(out), step=step, rank=rank, path=str(path),
                              op_type=get("op type"), stats=stats, extra=extra))
    return out
