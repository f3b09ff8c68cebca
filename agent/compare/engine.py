"""The comparison itself: read both sides, pair, compute the metrics pair by pair, judge.

One pair at a time: each side's tensor is loaded lazily (a memmap or a view), compared in
:mod:`.metrics`' chunked pass and dropped, so memory stays bounded by the largest tensor's
chunk buffers whatever the tree's size. A tensor that cannot be read gives a row with its reason
(and ``ok`` None: no evidence either way); the comparison goes on.

The daemon calls :func:`compare_sides` with tensors it already discovered; the CLI calls
:func:`compare_paths`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, Callable, Iterator

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from ..health import beat
from ..dumps.msprobe import inf_extremes
from ..dumps.types import DumpError, DumpTensor
from ..fusion.suspect import CATALOGUE_ERROR_PATH, catalogue_error
from ..model import TensorStats
from .metrics import StatsDiff, TensorDiff, compare_arrays, compare_raw, compare_stats
from .across import Across, noise_floor, pair_across, plan as plan_across, settle
from .pairing import Pair, Side, filter_side, pair_sides, read_side, tensor_label
from .verdict import (PRESET_FLAGS, PRESETS, Judged, first_differing, first_diverging, stats_distance,
                      stats_within, tensor_within, tolerance)

Progress = Callable[[int, int, int, int], None]  # (bytes done, bytes in all, pairs done, pairs in all)


@dataclass(slots=True)
class Row:
    index: int
    pair: Pair
    tolerance: float
    diff: TensorDiff | None = None
    stats_diff: StatsDiff | None = None
    target_stats: TensorStats | None = None
    bench_stats: TensorStats | None = None
    equal: bool = False
    ok: bool | None = None       # passes the preset (strict: within tolerance); None: not compared
    fail_reason: str = ""

    @property
    def target(self) -> DumpTensor:
        return self.pair.target

    @property
    def bench(self) -> DumpTensor:
        return self.pair.bench

    def judged(self) -> Judged:
        t = self.pair.target
        return Judged(step=t.step, rank=t.rank, order=t.order, op=t.name, io=_io(t),
                      tensor=tensor_label(t), ok=self.ok, equal=self.equal, index=self.index)


def _io(t: DumpTensor) -> str:
    """Parameters are inputs of the op that reads them."""
    return "output" if t.io in ("output", "") else "input"


@dataclass(slots=True)
class CompareResult:
    target: Side
    bench: Side
    preset: str
    mode: str                    # "benchmark" | "rerun"
    rows: list[Row] = field(default_factory=list)
    unmatched: list[dict[str, Any]] = field(default_factory=list)
    unmatched_tensors: list[tuple[str, DumpTensor]] = field(default_factory=list)
    first_diverging_op: dict[str, Any] | None = None
    corrupted_input: dict[str, Any] | None = None
    first_differing_tensor: dict[str, Any] | None = None
    across: Across | None = None     # a fusion-on run against a fusion-off run (across.py)
    fusion: Any = None               # the compiler's files (agent/fusion/context.py FusionContext)
    notes: list[dict[str, str]] = field(default_factory=list)   # errors of neither side (the catalogue)

    @property
    def identical(self) -> bool:
        return bool(self.rows) and not self.unmatched and all(r.equal for r in self.rows)

    @property
    def diverged(self) -> bool:
        return any(r.ok is False for r in self.rows)

    @property
    def errors(self) -> list[dict[str, str]]:
        out = [{"side": "target", "path": p, "reason": r} for p, r in self.target.errors]
        out += [{"side": "bench", "path": p, "reason": r} for p, r in self.bench.errors]
        out += [{"side": "pair", "path": r.target.path, "reason": r.fail_reason}
                for r in self.rows if r.ok is None and r.fail_reason]
        return out + self.notes


def _stats_of(t: DumpTensor) -> TensorStats:
    """Given statistics, or one pass over the data. The pass keeps the pages it reads in the page
    cache (``drop_cache=False``): the comparison has just read them, and dropping them made the
    next compare of the same trees read the verdict's tensors from disk again."""
    if t.load is None and t.stats is not None:
        return t.stats
    raw = t.raw() if t.raw is not None else None
    if raw is not None:
        from ..dumps.scanner import scan_words   # only for the tensors a verdict names
        s = scan_words(raw.words, raw.code, t.dtype, raw.shape, name=t.name, io=t.io, index=t.index)
        if s is not None:
            return replace(s, step=t.step, rank=t.rank, path=t.path)
    from ..dumps.tensorstats import statistics   # the scanner: only for the tensors a verdict names
    return statistics(t, drop_cache=False)


def compare_pair(index: int, pair: Pair, preset: str, rerun: bool) -> Row:
    """Compare one pair and judge it under ``preset`` (``rerun``: bitwise equality)."""
    t, b = pair.target, pair.bench
    row = Row(index, pair, 0.0 if rerun else tolerance(t.dtype, b.dtype))
    try:
        if t.load is not None and b.load is not None:
            if math.prod(t.shape) != math.prod(b.shape):
                row.fail_reason = f"shape mismatch: target {list(t.shape)}, bench {list(b.shape)}"
                row.ok = False
                return row
            d = _compare_raw(t, b)   # float words the C kernel reads whole: no numpy, same metrics
            if d is not None:
                flat = "shapes differ, compared flattened" if tuple(t.shape) != tuple(b.shape) else ""
                row.diff = d
                row.equal = d.bitwise_equal
                row.fail_reason = "; ".join(s for s in (flat, d.fail_reason) if s)
                row.ok = _judged(d, row.tolerance, preset, rerun, t)
                return row
            x, y = t.load(), b.load()
            if x.shape != y.shape:   # same element count: compared flat, as msaccucmp does
                x, y = x.reshape(-1), y.reshape(-1)
                row.fail_reason = "shapes differ, compared flattened"
            d = row.diff = compare_arrays(x, y, target_dtype=t.dtype, bench_dtype=b.dtype)
            row.equal = d.bitwise_equal
            row.fail_reason = "; ".join(s for s in (row.fail_reason, d.fail_reason) if s)
            if d.count == 0 and not d.bitwise_equal and x.size:   # a dtype the metrics cannot read
                row.equal = _same_bytes(x, y)
                row.ok = row.equal if (rerun or row.equal) else None
                return row
            row.ok = _judged(d, row.tolerance, preset, rerun, t)
            return row
        ts, bs = row.target_stats, row.bench_stats = _stats_of(t), _stats_of(b)
        sd = row.stats_diff = compare_stats(ts, bs)
        row.equal = sd.equal
        row.fail_reason = sd.fail_reason
        # the peers' presets are defined on tensor metrics; statistics get the strict rule
        row.ok = sd.equal if rerun else stats_within(ts, bs, row.tolerance)
    except Exception as exc:  # noqa: BLE001 - one hostile file must not end the whole comparison
        row.fail_reason = f"cannot compare: {type(exc).__name__}: {exc}"[:500]
        row.ok = None
    return row


def _compare_raw(t: DumpTensor, b: DumpTensor) -> TensorDiff | None:
    """The pair's metrics from both sides' raw words (DumpTensor.raw), or None: load them."""
    if t.raw is None or b.raw is None:
        return None
    rt = t.raw()
    rb = b.raw() if rt is not None else None
    return compare_raw(rt, rb) if rt is not None and rb is not None else None


def _judged(d: TensorDiff, tol: float, preset: str, rerun: bool, t: DumpTensor) -> bool:
    """Whether the pair passes: bitwise under ``rerun``, else the preset's rule."""
    if rerun:
        return d.bitwise_equal
    if preset == "strict":
        return tensor_within(d, tol)
    return not PRESET_FLAGS[preset](d.metrics, _io(t))


def _same_bytes(x: np.ndarray, y: np.ndarray) -> bool:
    """Bitwise equality for dtypes without metrics (complex, records), block by block."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    fx, fy = x.reshape(-1), y.reshape(-1)
    step = max(1, (1 << 22) // max(x.dtype.itemsize, 1))
    return all(fx[i:i + step].tobytes() == fy[i:i + step].tobytes() for i in range(0, fx.size, step))


def compare_sides(target: Side, bench: Side, *, preset: str = "strict", rerun: bool = False,
                  step: int | None = None, rank: int | None = None,
                  progress: Progress | None = None, fusion: Any = None, jobs: int = 1) -> CompareResult:
    """Pair, compare and judge two already-read sides. ``fusion``: the executed graph and fusion
    report (FusionContext) of either run: names the passes of a fused op, and pairs a fusion-on
    graph dump with a fusion-off one (across.py). ``jobs``: pairs compared at once on that many
    threads (the kernels release the GIL); the rows, their order and every bit of their
    metrics are the same for any number (each pair is computed whole by one thread)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    filter_side(target, step, rank)
    filter_side(bench, step, rank)
    across = plan_across(target, bench, getattr(fusion, "graph", None))
    pairing = pair_across(target, bench, across) if across is not None else pair_sides(target, bench)
    res = CompareResult(target, bench, preset, "rerun" if rerun else "benchmark",
                        unmatched=pairing.unmatched, unmatched_tensors=pairing.unmatched_tensors,
                        across=across, fusion=fusion)
    n = len(pairing.pairs)
    if progress:
        from ..dumps.tensorstats import tensor_bytes
    weights = [tensor_bytes(p.target) + tensor_bytes(p.bench) for p in pairing.pairs] if progress else []
    total, done = sum(weights), 0
    for i, row in enumerate(_rows(pairing.pairs, preset, rerun, jobs)):
        res.rows.append(row)
        beat()
        if progress is not None:
            done += weights[i]
            progress(done, total, i + 1, n)
    if across is not None and not rerun and preset == "strict":
        noise_floor(res.rows)
    judged = [r.judged() for r in res.rows]
    res.first_diverging_op, res.corrupted_input = first_diverging(judged, preset, rerun)
    if across is not None and across.level == "module":
        res.first_diverging_op, res.corrupted_input = settle(res.first_diverging_op, res.corrupted_input, res.rows)
    for where in (res.first_diverging_op, res.corrupted_input):
        if where is not None:
            where.update(_details(res.rows[where["row"]]))
    if res.first_diverging_op is not None or res.unmatched or across is not None:
        # the fused-API catalogue was consulted (a name on one side only: across.py) or will be
        # (the suspect of the first diverging op: report.py); one it could not read is listed
        broken = catalogue_error()
        if broken is not None:
            res.notes.append({"side": "pair", "path": CATALOGUE_ERROR_PATH, "reason": broken})
    first = first_differing(judged)
    if first is not None:
        res.first_differing_tensor = {"step": first.step, "rank": first.rank, "op": first.op,
                                      "tensor": first.tensor, "row": first.index,
                                      **_details(res.rows[first.index])}
    return res


def _rows(pairs: list[Pair], preset: str, rerun: bool, jobs: int) -> Iterator[Row]:
    """The pairs' rows in order, ``jobs`` pairs at a time (one thread: here, no pool)."""
    if jobs <= 1 or len(pairs) <= 1:
        yield from (compare_pair(i, p, preset, rerun) for i, p in enumerate(pairs))
        return
    from concurrent.futures import ThreadPoolExecutor   # here: --jobs 1 does without its imports
    with ThreadPoolExecutor(max_workers=min(jobs, len(pairs)), thread_name_prefix="compare") as pool:
        ahead = deque()   # a bounded window: a slow pair never lets the others pile up
        it = iter(enumerate(pairs))
        for i, p in islice(it, 2 * jobs):
            ahead.append(pool.submit(compare_pair, i, p, preset, rerun))
        while ahead:
            row = ahead.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                ahead.append(pool.submit(compare_pair, nxt[0], nxt[1], preset, rerun))
            yield row


def _details(row: Row) -> dict[str, Any]:
    """What a reader needs to see about one tensor: its metrics (or statistics) on both sides."""
    t, b = row.target, row.bench
    out: dict[str, Any] = {"op_type": t.op_type, "dtype": t.dtype, "bench_dtype": b.dtype,
                           "shape": list(t.shape), "tolerance": row.tolerance,
                           "bitwise_equal": row.equal, "within": row.ok}
    if row.diff is not None:
        d = row.diff
        out.update(metrics=dict(d.metrics), count=d.count, differ=d.differ,
                   first_diff_index=d.first_diff_index, max_abs_index=d.max_abs_index,
                   nonfinite_mismatch=d.nonfinite_mismatch)
    if row.target_stats is None or row.bench_stats is None:
        try:   # only for the few tensors a verdict names: one more pass over each
            row.target_stats, row.bench_stats = _stats_of(t), _stats_of(b)
        except (DumpError, OSError, ValueError, TypeError):
            pass
    if row.target_stats is not None and row.bench_stats is not None:
        out.update(stats_distance=stats_distance(row.target_stats, row.bench_stats),
                   target_stats=_stat_dict(row.target_stats), bench_stats=_stat_dict(row.bench_stats))
    if row.fail_reason:
        out["fail_reason"] = row.fail_reason
    return out


def _stat_dict(s: TensorStats) -> dict[str, Any]:
    mx, mn = inf_extremes(s.max, s.min, s.pos_inf, s.neg_inf)   # ±Inf shown as msprobe shows them
    return {"max": mx, "min": mn, "mean": s.mean, "l2norm": s.l2norm, "nan": s.nan,
            "pos_inf": s.pos_inf, "neg_inf": s.neg_inf}


def compare_paths(bench: str, target: str, **kw: Any) -> CompareResult:
    """Read both trees and compare them (raises FileNotFoundError for a missing path)."""
    return compare_sides(read_side(target), read_side(bench), **kw)
