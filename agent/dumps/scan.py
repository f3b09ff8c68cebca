"""``scan``: find a tree's dumps, compute per-tensor statistics, name the first bad op, decode
overflow debug files, and judge it all with the same rules the daemon uses.

Layouts are recognised by their files: msprobe (``dump.json``), CANN binary dumps (their file
names; step and rank come from the directory path), MindSpore (``…{input|output}.{slot}.{format}.npy``
names, ``statistic.csv``), and any other ``.npy``/``.npz`` tree, at any depth and tree by tree
(:mod:`.discovery`: one unreadable tree never hides another). Statistics come from the dump
itself when it has no tensor data (msprobe statistics mode, ``statistic.csv``), otherwise from one
blocked pass of the scanner. ``Opdebug.Node_OpDebug.*`` files next to CANN dumps are decoded
into overflow records matched to the overflowing op's own dump file. A file that cannot be read
is reported with its reason; the scan goes on.

:func:`scan_dump` is the raw result (the daemon's scan thread); :func:`scan` adds ``findings``
by feeding :func:`.samples.result_samples` -- the daemon's own samples -- to a ``Pipeline``.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import asdict, replace
from pathlib import Path
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterator


from ..health import beat, bind, bound
from ..model import TensorStats
from .cann import dump_dir_location, parse_dump_name
from .cache import ScanCache
from .discovery import MAX_FILES, Walk, discover, walk  # noqa: F401 - discover is re-exported
from .msprobe import inf_extremes  # noqa: F401 - re-exported
from .tensorstats import statistics, tensor_bytes
from .opdebug import find_overflow_ops
from .types import DumpError, DumpTensor

MAX_UNREADABLE = 16        # unreadable tensors named in first_nonfinite["unreadable_before"]
MAX_OPDEBUG_FILES = 10_000  # per scan: each is decoded, and each overflow becomes a JSON entry
SPREAD_MIN_BYTES = 32 << 20  # spread: tensors at least this big get the idle jobs as threads
Progress = Callable[[int, int, int, int], None]  # (bytes done, bytes in all, tensors done, tensors in all)


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


def _op_key(t: DumpTensor) -> tuple:
    """An op's place in the global order: step, execution order, rank (None as -1), name."""
    return (t.step if t.step is not None else -1, t.order, t.rank if t.rank is not None else -1, t.name)


def _where(t: DumpTensor) -> dict[str, Any]:
    return {"step": t.step, "rank": t.rank, "op": t.name, "tensor": f"{t.io}[{t.index}]"}


def first_bad_op(tensors: list[DumpTensor], stats: list[TensorStats],
                 unreadable: list[tuple[DumpTensor, str]] | None = None) -> dict[str, Any] | None:
    """msprobe's rule: the first op, in execution order, whose inputs are all finite while an
    output is not; across steps and ranks, the earliest. Without such an op (e.g. an input was
    already bad when the dump began), the first non-finite tensor.

    ``unreadable``: tensors whose data could not be read, with why. One that comes before the op
    found (or is one of its inputs) may have been the true first non-finite tensor: the answer
    then says ``"uncertain": true`` and lists them in ``unreadable_before`` (the earliest first)."""
    ops: dict[tuple, list[tuple[DumpTensor, TensorStats]]] = {}
    for t, s in zip(tensors, stats):
        ops.setdefault(_op_key(t), []).append((t, s))
    found = fallback = None
    for key in sorted(ops, key=lambda k: k[:3]):   # stable: ops at one place keep the dump's order
        items = ops[key]
        inputs = [s for t, s in items if t.io in ("input", "param")]
        bad_out = [(t, s) for t, s in items if t.io not in ("input", "param") and s.nonfinite]
        if bad_out and not any(s.nonfinite for s in inputs):
            found = (key, dict(_where(bad_out[0][0]), by="op"))
            break
        if fallback is None:
            bad = [t for t, s in items if s.nonfinite]
            if bad:
                fallback = (key, dict(_where(bad[0]), by="first_tensor"))
    if found is None:
        found = fallback
    if found is None:
        return None
    key, first = found
    before = sorted(((t, why) for t, why in unreadable or ()
                     if _op_key(t)[:3] < key[:3] or (_op_key(t) == key and t.io in ("input", "param"))),
                    key=lambda u: _op_key(u[0])[:3])
    if before:
        first["uncertain"] = True
        first["unreadable_before"] = [dict(_where(t), path=t.path, reason=why) for t, why in before[:MAX_UNREADABLE]]
        first["unreadable_before_count"] = len(before)
    return first


def _in_order(items: list[Any], fn: Callable[[Any], Any], jobs: int,
              guard: Callable[[], ContextManager[None]] | None = None) -> Iterator[Any]:
    """``fn(item)`` for each item, yielded in the items' order, computed by ``jobs`` threads at
    once (daemon threads: a file stuck in the kernel never holds up the process's exit). Each
    feeds the caller's heartbeat (agent/health.py: progress, cancellation) and runs under
    ``guard()`` (the daemon's symlink confinement is per thread). An exception ``fn`` raises comes
    out at its item's turn; once the caller stops reading, the threads take no new item."""
    hb = bound()
    cond = threading.Condition()
    done: dict[int, tuple[bool, Any]] = {}
    state = {"next": 0, "stop": False}

    def work() -> None:
        bind(hb)
        with guard() if guard is not None else nullcontext():
            while True:
                with cond:
                    i = state["next"]
                    if state["stop"] or i >= len(items):
                        return
                    state["next"] = i + 1
                try:
                    out: tuple[bool, Any] = (True, fn(items[i]))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                    out = (False, exc)
                with cond:
                    done[i] = out
                    cond.notify_all()

    for k in range(min(jobs, len(items))):
        threading.Thread(target=work, name=f"scan-job-{k}", daemon=True).start()
    try:
        for i in range(len(items)):
            with cond:
                while i not in done:
                    cond.wait()
                ok, value = done.pop(i)
            if not ok:
                raise value
            yield value
    finally:
        with cond:
            state["stop"] = True


def scan_dump(path: Path, step: int | None = None, progress: Progress | None = None,
              threads: int = 1, drop_cache: bool = True, files: Walk | None = None,
              cache: ScanCache | None = None, jobs: int = 1,
              guard: Callable[[], ContextManager[None]] | None = None, spread: bool = False) -> dict[str, Any]:
    """Statistics, first bad op, overflows and unreadable files of one tree (no findings).
    ``progress(bytes done, bytes in all, tensors done, tensors in all)``; ``drop_cache=False``
    keeps the pages read in the page cache (a comparison reads them next). ``files``: the files
    that make the tree (default: every file under ``path``; the daemon gives a directory's own,
    agent/dumps/schedule.py); ``cache``: unchanged files answered from it (agent/dumps/cache.py).

    ``jobs``: tensors scanned at once, each by its own thread (``threads`` more per tensor): the
    kernels and the reads release the GIL. The result is the same for any ``jobs`` (the same
    statistics bit for bit, in the same order); what it adds to memory is one read buffer per
    job and thread (agent/dumps/windows.py CHUNK_BYTES; README "scan --jobs N"). ``guard``:
    entered by each job's thread. ``spread``: where fewer tensors are left to read than ``jobs``
    (one big file), the jobs left idle split the passes of the big tensors (at least
    ``SPREAD_MIN_BYTES``) as threads; never more threads than ``jobs`` in all (or ``threads`` per
    tensor, where that is more), and the statistics do not depend on the number of threads."""
    w = walk(path) if files is None else files
    if cache is not None:
        cache.begin()
    unreadable: list[tuple[DumpTensor, str]] = []   # may hold the true first NaN (first_bad_op)
    tensors, errors, layout = discover(path, w.files, cache, unreadable)
    errors = w.errors + errors
    found = overflows(w.files, tensors, errors) if layout in ("cann", "mixed") else []
    if step is not None:
        tensors = [t for t in tensors if t.step == step]
        found = [o for o in found if o["step"] == step]
    kept: list[DumpTensor] = []
    stats: list[TensorStats] = []
    total = sum(tensor_bytes(t) for t in tensors)
    lock = threading.Lock()
    done, finished, counted = 0, 0, [0] * len(tensors)   # bytes read in all, tensors done, bytes per tensor

    def on_bytes(i: int, n: int) -> None:
        nonlocal done
        with lock:
            done += n
            counted[i] += n
            if progress is not None:
                progress(min(done, total), total, finished, len(tensors))

    # the cache is the caller's alone (no lock): asked here, filled below, in the tensors' order
    known = [cache.stats(t) if cache is not None else None for t in tensors]

    pending = sum(k is None for k in known)
    per = max(threads, jobs // pending) if spread and 0 < pending < jobs else threads

    def one(i: int) -> TensorStats | str:
        if known[i] is not None:
            return known[i]   # type: ignore[return-value]
        n = per if tensor_bytes(tensors[i]) >= SPREAD_MIN_BYTES else threads
        try:
            return statistics(tensors[i], n, (lambda n: on_bytes(i, n)) if progress is not None else None,
                              drop_cache)
        except (DumpError, TypeError, ValueError, OSError) as exc:
            return str(exc)   # the reason only: a traceback would hold the tensor's frames (its data)

    order = range(len(tensors))
    outcomes = (map(one, order) if jobs <= 1 or pending <= 1
                else _in_order(list(order), one, jobs, guard))
    for i, (t, s) in enumerate(zip(tensors, outcomes)):
        if isinstance(s, str):
            errors.append((t.path or t.name, s))
            unreadable.append((t, s))
        else:
            stats.append(replace(s, step=t.step, rank=t.rank, path=t.path))
            kept.append(t)
        if known[i] is None and cache is not None:
            cache.put_stats(t, s)
        with lock:
            done += tensor_bytes(t) - counted[i]   # what the pass read, as counted before it
            counted[i], finished = tensor_bytes(t), i + 1
        beat()
        if progress is not None:
            progress(min(done, total), total, i + 1, len(tensors))
    layouts = sorted({t.extra.get("layout", layout) for t in tensors}) if layout == "mixed" else [layout]
    first = first_bad_op(kept, stats, unreadable)
    op = first["op"] if first else (found[0]["op"] if found else None)
    out_errors = [{"path": p, "reason": r} for p, r in errors]
    return {"path": str(path), "layout": layout, "layouts": layouts, "tensors": [asdict(s) for s in stats],
            "first_nonfinite": first, "overflows": found, "fusion_suspect": fusion_suspect_of(op, errors=out_errors),
            "errors": out_errors, "warnings": []}


def with_inf_extremes(t: dict[str, Any]) -> dict[str, Any]:
    """A tensor's JSON with ``max``/``min`` as msprobe writes them (:func:`inf_extremes`); the
    scanner's finite-only values stay in ``finite_max``/``finite_min``."""
    mx, mn = t.get("max"), t.get("min")
    finite = lambda v: v if v is not None and math.isfinite(v) else None  # noqa: E731
    out = dict(t, finite_max=finite(mx), finite_min=finite(mn))
    out["max"], out["min"] = inf_extremes(mx, mn, t.get("pos_inf", 0), t.get("neg_inf", 0))
    return out


def fusion_suspect_of(op: str | None, graph: Any = None, report: Any = None,
                      errors: list[dict[str, str]] | None = None) -> dict[str, Any] | None:
    """Whether the first bad op (or the first overflowing one) is a fused API or an op a fusion
    pass made (docs/fusion.md). A catalogue that cannot be read gives None, and its error joins
    ``errors`` (once)."""
    from ..fusion.suspect import CATALOGUE_ERROR_PATH, CatalogueError, suspect
    try:
        found = suspect(op, graph, report)
    except CatalogueError as exc:
        entry = {"path": CATALOGUE_ERROR_PATH, "reason": str(exc)}
        if errors is not None and entry not in errors:
            errors.append(entry)
        return None
    return found.to_json() if found is not None else None


def with_fusion(r: dict[str, Any], fusion: Any) -> None:
    """Name the passes behind a scan's first bad op (or first overflowing op) from the compiler's
    files (agent/fusion/context.py FusionContext); unreadable ones join the scan's errors."""
    if not fusion.empty:
        first = r["first_nonfinite"]
        op = first["op"] if first else (r["overflows"][0]["op"] if r["overflows"] else None)
        r["fusion_suspect"] = fusion_suspect_of(op, fusion.graph, fusion.report, r["errors"])
    r["errors"] += [{"path": "fusion", "reason": e} for e in fusion.errors]
    if fusion.warnings:   # a bounded search cut short: a note, never an unreadable file
        r.setdefault("warnings", []).extend(fusion.warnings)
