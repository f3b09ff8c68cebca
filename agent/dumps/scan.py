"""``scan``: find a tree's dumps, compute per-tensor statistics, name the first bad op, decode
overflow debug files, and judge it all with the same rules the daemon uses.

Layouts are recognised by their files: msprobe (``dump.json``), CANN binary dumps (their file
names; step and rank come from the directory path), MindSpore (``…{input|output}.{slot}.{format}.npy``
names, ``statistic.csv``), and any other ``.npy``/``.npz`` tree. Statistics come from the dump
itself when it has no tensor data (msprobe statistics mode, ``statistic.csv``), otherwise from one
blocked pass of the scanner. ``Opdebug.Node_OpDebug.*`` files next to CANN dumps are decoded
into overflow records matched to the overflowing op's own dump file. A file that cannot be read
is reported with its reason; the scan goes on.

:func:`scan_dump` is the raw result (the daemon's scan thread); :func:`scan` adds ``findings``
by feeding :func:`.schedule.result_samples` -- the daemon's own samples -- to a ``Pipeline``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..health import beat
from ..model import TensorStats
from .cann import dump_dir_location, list_dump_dir, parse_dump_name
from .mindspore import parse_npy_name, read_mindspore_npy_dir, read_statistic_csv
from .msprobe import list_msprobe_dump
from .npy import read_npy, read_npz
from .opdebug import find_overflow_ops
from .scanner import scan_array
from .types import DumpError, DumpTensor
from .windows import scan_region

if TYPE_CHECKING:  # the rules stack is imported where it is used: `compare` never needs it
    from ..rulefile import RuleSet

MAX_FILES = 200_000  # bound the walk of a hostile or mistaken tree
MAX_OPDEBUG_FILES = 10_000  # per scan: each is decoded, and each overflow becomes a JSON entry
Progress = Callable[[int, int], None]  # (tensors done, tensors in all)


def _files(root: Path) -> Iterator[Path]:
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath) / name
            n += 1
            if n >= MAX_FILES:
                return


def _tree(path: Path) -> list[Path]:
    # anything but a directory is one file: a FIFO or device is then refused by name, not walked
    return list(_files(path)) if path.is_dir() else [path]


def _cann_tensors(files: list[Path]) -> tuple[list[DumpTensor], list[tuple[str, str]]]:
    """Tensors of every CANN dump directory, with step and rank from the directory's path; the
    execution order runs on across directories of the same (step, rank)."""
    tensors: list[DumpTensor] = []
    errors: list[tuple[str, str]] = []
    next_order: dict[tuple, int] = {}
    for d in sorted({str(f.parent) for f in files if parse_dump_name(f.name)}):
        found, errs = list_dump_dir(d)
        step, rank = dump_dir_location(d)
        base = next_order.get((step, rank), 0)
        for t in found:
            t.step, t.rank, t.order = step, rank, base + t.order
        if found:
            next_order[(step, rank)] = found[-1].order + 1
        tensors.extend(found)
        errors.extend(errs)
    return tensors, errors


def discover(path: Path, files: list[Path] | None = None,
             ) -> tuple[list[DumpTensor], list[tuple[str, str]], str]:
    """All tensors under ``path`` in execution order, the unreadable files, and the layout."""
    errors: list[tuple[str, str]] = []
    files = _tree(path) if files is None else files
    if any(f.name == "dump.json" for f in files):
        try:
            return list_msprobe_dump(path), errors, "msprobe"
        except DumpError as exc:
            return [], [(str(path), str(exc))], "msprobe"
    if any(parse_dump_name(f.name) for f in files):
        tensors, errors = _cann_tensors(files)
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


def overflows(files: list[Path], tensors: list[DumpTensor], errors: list[tuple[str, str]],
              ) -> list[dict[str, Any]]:
    """Every overflow record of the tree's Opdebug files, each matched (by task and stream id) to
    the overflowing op's dump file in the same directory; the earliest debug file first."""
    by_dir: dict[str, list[str]] = {}
    n = 0
    for f in files:
        meta = parse_dump_name(f.name)
        if meta and meta["is_opdebug"] and n < MAX_OPDEBUG_FILES:
            by_dir.setdefault(str(f.parent), []).append(str(f))
            n += 1
    if not by_dir:
        return []
    near: dict[str, list[DumpTensor]] = {}
    for t in tensors:
        near.setdefault(os.path.dirname(t.path), []).append(t)
    out = []
    for d, debug in by_dir.items():
        step, rank = dump_dir_location(d)
        for op in find_overflow_ops(debug, near.get(d, []), errors=errors):
            rec = op.record
            out.append({"step": step, "rank": rank, "op": op.op_name, "op_type": op.op_type,
                        "task_id": rec.task_id, "stream_id": rec.stream_id,
                        "accelerator": rec.accelerator, "status": ",".join(rec.flags),
                        "status_code": rec.status, "record": rec.layout, "timestamp": rec.timestamp,
                        "debug_file": op.debug_file, "file": op.path})
    out.sort(key=lambda o: (o["timestamp"] is None, o["timestamp"] or 0, os.path.basename(o["debug_file"])))
    return out


def statistics(t: DumpTensor, threads: int = 1, drop_cache: bool = True) -> TensorStats:
    """The tensor's statistics: given by the dump, or computed in one pass over its data (read in
    bounded chunks where the data lies in a file: agent/dumps/windows.py; ``drop_cache``: drop
    the pages read from the page cache)."""
    if t.load is None:
        if t.stats is None:
            raise DumpError(f"{t.path or t.name}: neither data nor statistics")
        return replace(t.stats, step=t.step, rank=t.rank, path=t.path)
    region = t.region() if t.region is not None else None
    if region is not None:
        s = scan_region(region, dtype=t.dtype, name=t.name, io=t.io, index=t.index, threads=threads,
                        drop_cache=drop_cache)
    else:
        s = scan_array(t.load(), dtype=t.dtype, name=t.name, io=t.io, index=t.index, threads=threads)
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


def scan_dump(path: Path, step: int | None = None, progress: Progress | None = None,
              threads: int = 1, drop_cache: bool = True) -> dict[str, Any]:
    """Statistics, first bad op, overflows and unreadable files of one tree (no findings).
    ``drop_cache=False`` keeps the pages read in the page cache (a comparison reads them next)."""
    files = _tree(path)
    tensors, errors, layout = discover(path, files)
    found = overflows(files, tensors, errors) if layout == "cann" else []
    if step is not None:
        tensors = [t for t in tensors if t.step == step]
        found = [o for o in found if o["step"] == step]
    kept: list[DumpTensor] = []
    stats: list[TensorStats] = []
    for i, t in enumerate(tensors):
        try:
            stats.append(statistics(t, threads, drop_cache))
            kept.append(t)
        except (DumpError, TypeError, ValueError, OSError) as exc:
            errors.append((t.path or t.name, str(exc)))
        beat()
        if progress is not None:
            progress(i + 1, len(tensors))
    return {"path": str(path), "layout": layout, "tensors": [asdict(s) for s in stats],
            "first_nonfinite": first_bad_op(kept, stats), "overflows": found,
            "errors": [{"path": p, "reason": r} for p, r in errors]}


def findings(result: dict[str, Any], rules: RuleSet, labels: dict[str, str] | None = None,
             ) -> list[dict[str, Any]]:
    """Judge a scan result with ``rules`` exactly as the daemon does: the same samples, the
    same detectors, a fresh pipeline."""
    from ..pipeline import Pipeline
    from .schedule import result_samples  # schedule imports this module for the scan thread
    pipeline = Pipeline(rules.fresh(), max_series=1 << 16, keep_findings=100_000)
    pipeline.process(result_samples(result, labels or {}))
    out = []
    for f in pipeline.findings:
        lab, ev = dict(f.labels), f.evidence
        rank: Any = lab.get("rank")
        out.append({"rule": f.rule, "kind": f.kind, "severity": f.severity, "step": f.step,
                    "rank": int(rank) if rank and rank.isdigit() else rank, "op": lab.get("op"), "tensor": ev.get("tensor"),
                    "summary": f.annotations.get("summary") or f.summary, "labels": lab, "evidence": ev})
    return out


def scan(path: Path, step: int | None = None, rules: RuleSet | None = None,
         labels: dict[str, str] | None = None, progress: Progress | None = None,
         threads: int = 1) -> dict[str, Any]:
    """``precision-agent scan``: :func:`scan_dump` plus the findings of ``rules`` (default: the
    shipped rule files). ``threads``: scanner threads per tensor (the daemon keeps 1)."""
    if rules is None:
        from ..rulefile import default_rules_dir, load_rules
        rules = load_rules([default_rules_dir()])
    r = scan_dump(path, step, progress, threads)
    r["findings"] = findings(r, rules, labels)
    return r


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
    ovf = r.get("overflows") or []
    lines.append(f"overflows: {len(ovf)}" + (" (earliest first)" if ovf else ""))
    for o in ovf[:limit]:
        lines.append(f"  step {o['step']} rank {o['rank']}  {o['op'] or '(dump file not found)'} [{o['op_type'] or '?'}]"
                     f"  {o['accelerator']} task {o['task_id']} stream {o['stream_id']}: {o['status'] or 'no flag'}")
    fs = r.get("findings") or []
    lines.append(f"findings: {len(fs)}")
    for f in fs[:limit]:
        lines.append(f"  [{f['severity']}] {f['rule']} step {f['step']}: {f['summary']}")
    for e in r["errors"][:limit]:
        lines.append(f"unreadable: {e['path']}: {e['reason']}")
    return "\n".join(lines)
