"""Verdicts: when a compared tensor counts as diverged, and which op is to blame.

Presets reproduce the peers' rules (reference ascend-formats.md §3.4):

- ``precision_tool``: an op is suspect when an **output**'s cosine is ≤ 0.98;
- ``msaccucmp``: a tensor is flagged when its cosine is < 0.99;
- ``msquickcmp``: a tensor is flagged unless cosine > 0.99, RED < 0.05, KLD < 0.005, RMSE < 1 and
  MeanRelativeError < 1; a NaN metric violates nothing (so NaN-cosine rows are skipped, as
  msquickcmp does).

With a preset the first diverging op is simply the op of the first flagged tensor.

``strict`` (the default) asks for each tensor whether it matches the benchmark within a
**dtype-aware tolerance** on the relative Euclidean distance ``‖t−b‖/‖b‖`` (all-zero benchmark:
on max|t−b|), non-finite positions must agree exactly, integers and bools must be equal:

====== ===== ============ ==========================================================
dtype  bits  tolerance    why
====== ===== ============ ==========================================================
fp64   53    2^-43        10 bits of slack below the unit roundoff
fp32   24    2^-14 ≈ 6e-5 10 bits of slack: reductions summed in another order differ by
                          ~√K·u (K ≤ 10^6 terms stays inside); one rounding of the output
                          to fp16/TF32/HF32 gives RED ≈ 0.6·2^-11 ≈ 3e-4, 5× above it
                          (the corpus' fp16-computed linear: 3.09e-4, cosine 0.99999996)
fp16   11    2^-9 ≈ 2e-3  2 bits: half-precision results are accumulated wider and rounded
                          once, so a legitimate rerun differs by an ulp here and there
bf16   8     2^-6 ≈ 2e-2  2 bits, same reason
fp8    3–4   2^-1 / 2^-2  2 bits
====== ===== ============ ==========================================================

When target and benchmark dtypes differ the coarser one sets the tolerance. Statistics-only
dumps compare max, min and mean (relative to the benchmark's max|x|) and the L2 norm (relative to
its own value) against the same tolerance.

The strict rule then walks ops in execution order: the **first op whose inputs all match but an
output does not** lost precision (``lost_precision``). An op that reads a differing input before
any dumped op produced a difference was fed from outside the dump (a weight, a batch, optimizer
state): nothing lost precision there, an input was corrupted (``input_differs``). ``rerun``
mode (two runs of one configuration) has no tolerance: the first op with any bit that differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..model import TensorStats

PRESETS = ("strict", "precision_tool", "msaccucmp", "msquickcmp")
PRECISION_BITS = {"float64": 53, "float32": 24, "complex64": 24, "complex128": 53, "float16": 11,
                  "bfloat16": 8, "float8_e4m3fn": 4, "float8_e4m3": 4, "float8_e5m2": 3}


def precision_bits(dtype: str) -> int | None:
    """Significand bits of a float dtype (None: integer, bool or unknown -> exact match)."""
    return PRECISION_BITS.get(dtype.lower())


def tolerance(target_dtype: str, bench_dtype: str) -> float:
    """The strict rule's RED tolerance for a pair of dtypes; 0.0 means bitwise equality."""
    bits = [b for b in (precision_bits(target_dtype), precision_bits(bench_dtype)) if b]
    if not bits:
        return 0.0
    p = min(bits)
    slack = 10 if p >= 24 else 2
    return 2.0 ** -(p - slack)


def _f(metrics: dict[str, float], name: str) -> float:
    v = metrics.get(name)
    return float("nan") if v is None else float(v)


def tensor_within(diff: Any, tol: float) -> bool:
    """Strict: does a TensorDiff match within ``tol``? (See the module docstring.)"""
    if diff.bitwise_equal:
        return True
    if diff.nonfinite_mismatch or tol <= 0.0:
        return False
    red = _f(diff.metrics, "RelativeEuclideanDistance")
    if not math.isfinite(red):
        return False
    if red == 0.0:   # all-zero benchmark (RED is defined 0 there): fall back on the absolute error
        mae = _f(diff.metrics, "MaxAbsoluteError")
        return math.isfinite(mae) and mae <= tol
    return red <= tol


def stats_distance(t: TensorStats, b: TensorStats) -> float:
    """Largest relative difference between two tensors' statistics; inf when non-finite counts
    or the presence of a statistic disagree."""
    if (t.nan > 0) != (b.nan > 0) or (t.pos_inf > 0) != (b.pos_inf > 0) or (t.neg_inf > 0) != (b.neg_inf > 0):
        return math.inf
    finite = [abs(v) for v in (b.max, b.min) if v is not None and math.isfinite(v)]
    scale = max(finite) if finite else 0.0
    worst = 0.0
    for tv, bv, ref in ((t.max, b.max, scale), (t.min, b.min, scale), (t.mean, b.mean, scale),
                        (t.l2norm, b.l2norm, abs(b.l2norm) if b.l2norm is not None else 0.0)):
        if tv is None and bv is None:
            continue
        if tv is None or bv is None:
            return math.inf
        if tv == bv or (math.isnan(tv) and math.isnan(bv)):
            continue
        d = abs(tv - bv)
        if not math.isfinite(d):
            return math.inf
        worst = max(worst, d / ref if ref > 0 and math.isfinite(ref) else d)
    return worst


def stats_within(t: TensorStats, b: TensorStats, tol: float) -> bool:
    d = stats_distance(t, b)
    return d == 0.0 or (tol > 0.0 and d <= tol)


# ------------------------------------------------------------------------------------ presets

def _precision_tool(m: dict[str, float], io: str) -> bool:
    return io == "output" and _f(m, "CosineSimilarity") <= 0.98


def _msaccucmp(m: dict[str, float], io: str) -> bool:
    return _f(m, "CosineSimilarity") < 0.99


def _msquickcmp(m: dict[str, float], io: str) -> bool:
    # violations, as msquickcmp tests them: a NaN metric (e.g. KLD of an all-zero bias) violates nothing
    return (_f(m, "CosineSimilarity") <= 0.99 or _f(m, "RelativeEuclideanDistance") >= 0.05
            or _f(m, "KullbackLeiblerDivergence") >= 0.005 or _f(m, "RootMeanSquareError") >= 1.0
            or _f(m, "MeanRelativeError") >= 1.0)


PRESET_FLAGS: dict[str, Callable[[dict[str, float], str], bool]] = {
    "precision_tool": _precision_tool, "msaccucmp": _msaccucmp, "msquickcmp": _msquickcmp}


@dataclass(slots=True)
class Judged:
    """What the verdict needs of one compared tensor (the engine's Row provides it)."""

    step: int | None
    rank: int | None
    order: int
    op: str
    io: str
    tensor: str
    ok: bool | None       # None: could not be compared (read error): no evidence either way
    equal: bool           # bitwise (or statistics) equal
    index: int = -1       # the row's number in the report


def _op_key(r: Judged) -> tuple:
    return (r.step if r.step is not None else -1, r.rank if r.rank is not None else -1, r.order, r.op)


def _by_op(rows: list[Judged]) -> list[list[Judged]]:
    ops: dict[tuple, list[Judged]] = {}
    for r in rows:
        ops.setdefault(_op_key(r), []).append(r)
    keys = sorted(ops, key=lambda k: (k[0], k[2], k[1]))   # earliest step, then execution order
    return [ops[k] for k in keys]


def _where(items: list[Judged], r: Judged, kind: str) -> dict[str, Any]:
    return {"step": r.step, "rank": r.rank, "op": r.op, "tensor": r.tensor, "kind": kind, "row": r.index,
            "inputs_match": all(x.ok is not False for x in items if x.io != "output")}


def first_diverging(rows: list[Judged], preset: str, rerun: bool = False
                    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(first diverging op, corrupted input) over rows whose ``ok`` the preset already set.

    Presets and rerun: the op of the first failing tensor. Strict: see the module docstring;
    the second value is set only when an input differed before any op lost precision."""
    ops = _by_op(rows)
    if rerun or preset != "strict":
        kind = "nondeterministic" if rerun else "threshold"
        for items in ops:
            bad = [r for r in items if r.ok is False]
            if bad:
                return _where(items, bad[0], kind), None
        return None, None
    leaves = [items for items in ops if not _is_module(items[0].op)]
    forward = {_twin_key(items[0]): items for items in ops if _twin_key(items[0]) is not None}
    corrupted = None
    seen_bad_output = False
    for items in (leaves if leaves else ops):
        inputs = [r for r in items if r.io != "output"]
        inputs += forward.get(_backward_of(items[0]), [])   # what autograd saved for it
        bad_out = [r for r in items if r.io == "output" and r.ok is False]
        bad_in = [r for r in inputs if r.ok is False]
        if bad_out and not bad_in:
            return _where(items, bad_out[0], "lost_precision"), corrupted
        if bad_in and corrupted is None and not seen_bad_output:
            corrupted = _where(items, bad_in[0], "input_differs")
        seen_bad_output = seen_bad_output or bool(bad_out)
    return None, corrupted


def _is_module(op: str) -> bool:
    """msprobe ``Module.*`` entries wrap API entries dumped before them (mix level): their outputs
    depend on parameters of inner modules they do not list, so in a dump that also has API
    entries only the API entries are judged."""
    return op.startswith("Module.")


_FWD, _BWD = ".forward", ".backward"


def _twin_key(r: Judged) -> tuple | None:
    """(step, rank, op) of a forward entry, keyed so its backward entry can find it."""
    if r.op.endswith(_FWD) or f"{_FWD}." in r.op:
        return (r.step, r.rank, r.op)
    return None


def _backward_of(r: Judged) -> tuple | None:
    """A backward entry's forward twin: ``X.N.backward`` -> ``X.N.forward`` (API),
    ``Module.p.C.backward.N`` -> ``Module.p.C.forward.N``. A backward op also reads the tensors
    its forward saved, which are not among its own inputs."""
    if r.op.endswith(_BWD):
        return (r.step, r.rank, r.op[: -len(_BWD)] + _FWD)
    head, sep, tail = r.op.rpartition(f"{_BWD}.")
    if sep and tail.isdigit():
        return (r.step, r.rank, f"{head}{_FWD}.{tail}")
    return None


def first_differing(rows: list[Judged]) -> Judged | None:
    """The first tensor, in (step, execution order, rank) order, that is not bitwise equal."""
    for items in _by_op(rows):
        for r in items:
            if not r.equal and r.ok is not None:
                return r
    return None
