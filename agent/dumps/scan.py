"""``scan``: find a tree's dumps, compute per-tensor statistics, name the first bad op.

Layouts are recognised by their files: msprobe (``dump.json``), CANN binary dumps (their file
names), MindSpore (``…{input|output}.{slot}.{format}.npy`` names, ``statistic.csv``), and any
other ``.npy``/``.npz`` tree. Statistics come from the dump itself when it has no tensor data
(msprobe statistics mode, ``statistic.csv``), otherwise from one blocked pass of the scanner.
A file that cannot be read is reported with its reason; the scan goes on.
"""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterator

from ..model import TensorStats
from .cann import list_dump_dir, parse_dump_name
from .mindspore import parse_npy_name, read_mindspore_npy_dir, read_statistic_csv
from .msprobe import list_msprobe_dump
from .npy import read_npy, read_npz
from .scanner import scan_array
from .types import DumpError, DumpTensor

MAX_FILES = 200_000  # bound the walk of a hostile or mistaken tree


def _files(root: Path) -> Iterator[Path]:
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath) / name
            n += 1
            if n >= MAX_FILES:
                return


def discover(path: Path) -> tuple[list[DumpTensor], list[tuple[str, str]], str]:
    """All tensors under ``path`` in execution order, the unreadable files, and the layout."""
    errors: list[tuple[str, str]] = []
    files = [path] if path.is_file() else list(_files(path))
    if any(f.name == "dump.json" for f in files):
        try:
            return list_msprobe_dump(path), errors, "msprobe"
        except DumpError as exc:
            return [], [(str(path), str(exc))], "msprobe"
    dirs_cann = sorted({str(f.parent) for f in files if parse_dump_name(f.name)})
    if dirs_cann:
        tensors: list[DumpTensor] = []
        for d in dirs_cann:
            found, errs = list_dump_dir(d)
            tensors.extend(found)
            errors.extend(errs)
        return tensors, errors, "cann"
    ms_dirs = sorted({str(f.parent) for f in files if f.suffix == ".npy" and parse_npy_name(f.name)})
    csvs = [f for f in files if f.name == "statistic.csv"]
    if ms_dirs or csvs:
        tensors = []
        for d in ms_dirs:
            try:
                tensors.extend(read_mindspore_npy_dir(d))
            except DumpError as exc:
                errors.append((d, str(exc)))
        for c in csvs:
            try:
                tensors.extend(read_statistic_csv(c))
            except DumpError as exc:
                errors.append((str(c), str(exc)))
        return tensors, errors, "mindspore"
    tensors = []
    base = path if path.is_dir() else path.parent
    for f in files:
        try:
            if f.suffix == ".npy":
                tensors.append(read_npy(f, name=str(f.relative_to(base))))
            elif f.suffix == ".npz":
                tensors.extend(read_npz(f))
        except DumpError as exc:
            errors.append((str(f), str(exc)))
    for i, t in enumerate(tensors):
        t.order, t.io = i, t.io or "output"
    return tensors, errors, "npy"


def statistics(t: DumpTensor) -> TensorStats:
    """The tensor's statistics: given by the dump, or computed in one pass over its data."""
    if t.load is None:
        if t.stats is None:
            raise DumpError(f"{t.path or t.name}: neither data nor statistics")
        return replace(t.stats, step=t.step, rank=t.rank, path=t.path)
    s = scan_array(t.load(), dtype=t.dtype, name=t.name, io=t.io, index=t.index)
    return replace(s, step=t.step, rank=t.rank, path=t.path)


def first_bad_op(tensors: list[DumpTensor], stats: list[TensorStats]) -> dict[str, Any] | None:
    """msprobe's rule: the first op, in execution order, whose inputs are all finite while an
    output is not; across steps and ranks, the earliest. Without such an op (e.g. an input was
    already bad when the dump began), the first non-finite tensor."""
    ops: dict[tuple, list[tuple[DumpTensor, TensorStats]]] = {}
    for t, s in zip(tensors, stats):
        ops.setdefault((t.step if t.step is not None else -1, t.rank if t.rank is not None else -1, t.order,
                        t.name), []).append((t, s))
    fallback = None
    for key in sorted(ops, key=lambda k: (k[0], k[2], k[1])):
        items = ops[key]
        inputs = [s for t, s in items if t.io in ("input", "param")]
        bad_out = [(t, s) for t, s in items if t.io not in ("input", "param") and s.nonfinite]
        if bad_out and not any(s.nonfinite for s in inputs):
            t, _ = bad_out[0]
            return {"step": t.step, "rank": t.rank, "op": t.name, "tensor": f"{t.io}[{t.index}]", "by": "op"}
        if fallback is None:
            bad = [(t, s) for t, s in items if s.nonfinite]
            if bad:
                t, _ = bad[0]
                fallback = {"step": t.step, "rank": t.rank, "op": t.name, "tensor": f"{t.io}[{t.index}]",
                            "by": "first_tensor"}
    return fallback


def scan(path: Path, step: int | None = None) -> dict[str, Any]:
    tensors, errors, layout = discover(path)
    if step is not None:
        tensors = [t for t in tensors if t.step == step]
    kept: list[DumpTensor] = []
    stats: list[TensorStats] = []
    for t in tensors:
        try:
            stats.append(statistics(t))
            kept.append(t)
        except (DumpError, TypeError, ValueError, OSError) as exc:
            errors.append((t.path or t.name, str(exc)))
    first = first_bad_op(kept, stats)
    findings: list[dict[str, Any]] = []
    if first is not None:
        findings.append({"rule": "DumpNonFinite", "kind": "nonfinite", "severity": "page", **first,
                         "summary": f"first non-finite output: {first['op']} {first['tensor']}"
                                    f" (step {first['step']}, rank {first['rank']})"})
    for s in stats:
        if s.fp16_saturated:
            findings.append({"rule": "DumpFp16Saturation", "kind": "fp16_saturation", "severity": "ticket",
                             "step": s.step, "rank": s.rank, "op": s.name, "tensor": f"{s.io}[{s.index}]",
                             "summary": f"{s.fp16_saturated} fp16 value(s) at ±65504 in {s.name}"})
    return {"path": str(path), "layout": layout, "tensors": [asdict(s) for s in stats],
            "first_nonfinite": first, "findings": findings,
            "errors": [{"path": p, "reason": r} for p, r in errors]}


def format_report(r: dict[str, Any], limit: int = 40) -> str:
    lines = [f"path:    {r['path']}", f"layout:  {r['layout']}", f"tensors: {len(r['tensors'])}"]
    bad = [t for t in r["tensors"] if t["nan"] or t["pos_inf"] or t["neg_inf"]]
    lines.append(f"with NaN/Inf: {len(bad)}")
    f = r["first_nonfinite"]
    lines.append("first bad op: " + (f"{f['op']} {f['tensor']} (step {f['step']}, rank {f['rank']})" if f else "none"))
    if bad:
        lines.append(f"{'step':>4} {'rank':>4}  {'tensor':<48} {'nan':>6} {'+inf':>6} {'-inf':>6} {'max':>12}")
        for t in bad[:limit]:
            lines.append(f"{str(t['step']):>4} {str(t['rank']):>4}  {(t['name'] + ' ' + t['io'] + str(t['index']))[:48]:<48}"
                         f" {t['nan']:>6} {t['pos_inf']:>6} {t['neg_inf']:>6} {str(t['max']):>12}")
    for e in r["errors"][:limit]:
        lines.append(f"unreadable: {e['path']}: {e['reason']}")
    return "\n".join(lines)
