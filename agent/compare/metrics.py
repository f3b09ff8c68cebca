"""How far one tensor is from its benchmark: msaccucmp's metric columns, msprobe's error ratios
and bitwise equality, in one chunked pass; when some block differs, a min/max pre-pass over the
raw data comes first (KLD normalises by each side's range), so a differing pair reads its data
twice and an identical pair once. The block kernels and their costs are in :mod:`..kernels.compare_numpy`;
where the optional C kernel is built (``kernels/compare.c``, glue in :mod:`..kernels.compare_c`), a float32,
float16 or bfloat16 block takes one pass of it instead of ~30 numpy calls, with the same
results within the tests' tolerances (``PRECISION_AGENT_KERNELS=numpy`` keeps numpy). A float32
pair (any kernel pair where its AVX-512 or AVX2 variant runs) has no pre-pass: pass 1 finds the ranges
along with every other metric, and pass 2 re-reads the differing blocks for KLD's terms only
(``compare_c.two_pass``); a block holding NaN/Inf takes numpy's path alone.

Definitions (x = target / "my" / NPU side, y = bench / golden side; N = number of elements)
--------------------------------------------------------------------------------------------
Values are flattened (C order) and cast to float32 first, as msaccucmp does; every sum is then
accumulated in float64 (block partials combined with ``math.fsum``). ε = ``np.finfo(float).eps``.

* CosineSimilarity = Σxy / (‖x‖‖y‖), clamped to [-1, 1]. N == 1 (shape () or all ones) → 1.0
  with CompareFailReason "this tensor is scalar."; ‖x‖ ≤ ε and ‖y‖ < ε → 1.0; otherwise one side
  with norm ≤ ε → NaN ("Cannot compare by Cosine Similarity. All the data is zero in …").
* MaxAbsoluteError = max|x−y|; MeanAbsoluteError = Σ|x−y| / N; RootMeanSquareError =
  sqrt(Σ(x−y)² / N).
* AccumulatedRelativeError = Σ over |y| > ε of |x/y − 1| (computed as |x−y|/|y|);
  MaxRelativeError = the max of the same terms (0 when no |y| > ε: those elements contribute 0,
  the reference is silent and 0 is what "contribute 0" gives); MeanRelativeError = the same sum
  / N (the mean is over *all* elements, as msaccucmp's ``where(…, 0)`` does).
* RelativeEuclideanDistance = sqrt(Σ(x−y)²) / sqrt(Σy²), 0 when sqrt(Σy²) ≤ ε.
* KullbackLeiblerDivergence: each side min-max normalised ((v−min)/(max−min); a constant side
  is left as is), clamped below at float32 eps, normalised to sum 1, then Σ p·log(p/q); |KLD| < ε
  → 0. NaN when *either* side is all zeros (the reference says "all zeros" without naming a side;
  a zero side carries no distribution, so we refuse it whichever it is). Identical tensors → 0
  without the second pass.
* OneThousandthErrRatio / FiveThousandthsErrRatio (msprobe): the fraction of elements whose
  relative error |x−y|/|y| is *below* 0.001 / 0.005 (1.0 is perfect). Where y == 0, msprobe adds
  ε to both sides, so the error is |x|/ε (0 when x is 0 too). Computed for every N ≥ 1, bool too.
* bool tensors (both sides bool): only CosineSimilarity and RelativeEuclideanDistance (on 0/1)
  and the two ratios; the other metrics are NaN. A bool side paired with a non-bool one is 0/1.
* target_stats / bench_stats: (mean, population std) of that side's finite values, float64 —
  msaccucmp's StandardDeviation column (which would print NaN for a tensor holding NaN).

NaN / Inf policy (msprobe's ``handle_inf_nan``, made stricter)
-------------------------------------------------------------
msaccucmp lets NaN propagate through numpy, so any NaN/Inf on either side makes its metrics NaN.
msprobe zeroes NaN/Inf on both sides when their positions agree and gives up otherwise. We do
the latter, per element: where both sides are NaN, or both +Inf, or both −Inf, the pair is set to
0 on both sides and compared like any equal pair; every other pair with a non-finite member
(NaN vs number, +Inf vs −Inf, Inf vs NaN) counts in ``nonfinite_mismatch``, and if there is any,
every metric is NaN with "The position of inf or nan in NPU and golden tensor do not match."
(msprobe would wrongly accept +Inf against −Inf.) Non-finiteness is judged on the float32 values,
so a float64 value beyond float32's range counts as Inf there.

Equality: ``bitwise_equal`` needs the same dtype, the same shape and identical bytes (so -0.0 vs
0.0 or two NaN payloads are not bitwise equal). ``differ`` / ``first_diff_index`` compare values
exactly in the original precision (float64 stays float64; NaN at the same place is equal, and
-0.0 == 0.0). Memory: three block-sized float64 buffers and two masks (``block_elems``, default
131072: 3.25 MiB; one float32/uint32 buffer more per side that needs rounding or is bfloat16),
whatever the tensor size, kept per thread between compares (fresh pages cost more than the
passes); a memmap is read block by block. No threads: BLAS dots stay below OpenBLAS's
threading size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from .. import kernels
from ..model import TensorStats
from ..dumps.types import RawTensor
from ..kernels import compare_c as blocks_c
from ..kernels.compare_numpy import (EPS, EPS32, RATIO_THRESHOLDS, Acc, Kld, Side, general_block, pairs, same_bytes,
                     scratch)
from ..kernels.compare_c import identical_block, revisit_identical
from ..kernels.compare_raw import passes

__all__ = ["BOOL_METRICS", "DEFAULT_BLOCK", "EPS", "EPS32", "METRIC_NAMES", "RATIO_NAMES",
           "RATIO_THRESHOLDS", "REASON_EMPTY", "REASON_NONFINITE", "REASON_SCALAR", "REASON_ZERO_X",
           "REASON_ZERO_Y", "StatsDiff", "TensorDiff", "compare_arrays", "compare_raw", "compare_stats"]

METRIC_NAMES: tuple[str, ...] = (
    "CosineSimilarity", "MaxAbsoluteError", "AccumulatedRelativeError", "RelativeEuclideanDistance",
    "KullbackLeiblerDivergence", "MeanAbsoluteError", "RootMeanSquareError", "MaxRelativeError",
    "MeanRelativeError")
RATIO_NAMES: tuple[str, ...] = ("OneThousandthErrRatio", "FiveThousandthsErrRatio")
BOOL_METRICS = ("CosineSimilarity", "RelativeEuclideanDistance")

DEFAULT_BLOCK = 1 << 17

REASON_SCALAR = "this tensor is scalar."
REASON_EMPTY = "this tensor is empty."
REASON_NONFINITE = "The position of inf or nan in NPU and golden tensor do not match."
REASON_ZERO_X = "Cannot compare by Cosine Similarity. All the data is zero in NPU dump data."
REASON_ZERO_Y = "Cannot compare by Cosine Similarity. All the data is zero in golden dump data."

@dataclass(slots=True)
class TensorDiff:
    metrics: dict[str, float]     # every name of METRIC_NAMES + RATIO_NAMES; NaN where undefined
    bitwise_equal: bool           # same dtype, shape and identical bytes
    count: int                    # elements compared (0 when nothing could be compared)
    differ: int                   # elements whose values differ (NaN vs NaN at one place: equal)
    first_diff_index: int | None  # flat (C-order) index of the first differing element
    max_abs_index: int | None     # flat index of MaxAbsoluteError (None when it is 0 or NaN)
    nonfinite_mismatch: int       # pairs with a NaN/Inf whose other member is not the same
    fail_reason: str              # msaccucmp-style CompareFailReason, '' when none
    target_stats: tuple[float, float] | None = None  # (mean, std), float64, finite values
    bench_stats: tuple[float, float] | None = None


@dataclass(slots=True)
class StatsDiff:
    diffs: dict[str, float]       # Max/Min/Mean/NormDiff (target - bench), *RelativeErr (fraction)
    equal: bool                   # the four statistics identical (NaN == NaN, inf == inf)
    fail_reason: str


def _nan_metrics() -> dict[str, float]:
    return {k: math.nan for k in METRIC_NAMES + RATIO_NAMES}

def _stats(s: list[float], q: list[float], n: int) -> tuple[float, float] | None:
    if n <= 0:
        return None
    mean = math.fsum(s) / n
    return mean, math.sqrt(max(math.fsum(q) / n - mean * mean, 0.0))


def _failed(reason: str, bitwise: bool = False, count: int = 0) -> TensorDiff:
    return TensorDiff(_nan_metrics(), bitwise, count, 0, None, None, 0, reason)


def compare_arrays(target: np.ndarray, bench: np.ndarray, *, target_dtype: str | None = None,
                   bench_dtype: str | None = None, block_elems: int = DEFAULT_BLOCK) -> TensorDiff:
    """Compare ``target`` (NPU / "my" side) with ``bench`` (golden side); see the module docstring.

    ``*_dtype="bfloat16"``: that array holds raw bfloat16 words (uint16), converted per block.
    Never raises on bad data: an unsupported dtype or a shape mismatch is a ``fail_reason``."""
    try:
        sx_, sy_ = Side(target, target_dtype), Side(bench, bench_dtype)
    except TypeError as e:
        return _failed(str(e))
    x, y = sx_.a, sy_.a
    if x.shape != y.shape:
        return _failed(f"Shape of NPU and golden tensor do not match: {x.shape} vs {y.shape}.")
    same_dtype = sx_.code == sy_.code and x.dtype == y.dtype
    if x.size == 0:
        return _failed(REASON_EMPTY, bitwise=same_dtype)
    n = max(1, int(block_elems))
    sc = scratch(min(n, x.size))
    acc = Acc()
    acc.bitwise = same_dtype
    uview = np.dtype(f"u{x.dtype.itemsize}") if same_dtype and x.dtype.itemsize in (1, 2, 4, 8) else None
    is_bool = sx_.code == "b1" and sy_.code == "b1"
    kld: Kld | None = None
    mod = kernels.get("compare")   # per call: a test's kernels.forced() applies
    kx, ky = (blocks_c.kind_of(sx_), blocks_c.kind_of(sy_)) if mod is not None else (None, None)
    with np.errstate(all="ignore"):
        if blocks_c.takes_whole(mod, kx, ky):
            got = blocks_c.two_pass(mod, sx_, sy_, kx, ky, n, acc, sc, uview)
            if got is not False:
                return _finish(count=int(x.size), is_bool=is_bool, acc=acc, kld=got)
            acc = Acc()   # a block the kernel refused: the one-pass flow, numpy for that block
            acc.bitwise = same_dtype
        for off, xr, yr in pairs(x, y, n):
            if uview is not None:
                same = blocks_c.identical(mod, kx, xr, yr) if kx is not None else True
                if same is not False:
                    sums = same if isinstance(same, tuple) else None
                    if sums is not None or same_bytes(xr, yr, uview, sc.b1):
                        identical_block(sx_, xr, off, acc, sc, kld, mod, sums)
                        continue
            if kld is None and not is_bool:  # the first differing block: KLD needs both ranges
                kld = Kld(sx_, sy_, x, y, n, sc, blocks_c.range_fn(mod) if mod is not None else None)
            acc.bitwise = False
            if mod is None or not blocks_c.general(mod, kx, ky, xr, yr, off, acc, kld):
                general_block(sx_, sy_, xr, yr, off, acc, sc, kld)
        if kld is not None and acc.kld_todo:
            revisit_identical(sx_, x, y, n, acc, sc, kld, mod)
        return _finish(count=int(x.size), is_bool=is_bool, acc=acc, kld=kld)


def compare_raw(target: RawTensor, bench: RawTensor, block_elems: int = DEFAULT_BLOCK) -> TensorDiff | None:
    """:func:`compare_arrays` of two tensors given as flat words (``DumpTensor.raw``), through the
    C kernel alone and without numpy; the same TensorDiff, bit for bit. None where that path
    does not take the pair (no kernel, or a block numpy must see): compare the arrays then."""
    mod = kernels.get("compare")
    if mod is None:
        return None
    got = passes(mod, target.words, bench.words, target.code, bench.code, max(1, int(block_elems)))
    if got is None:
        return None
    acc, kld = got
    return _finish(count=len(target.words), is_bool=False, acc=acc, kld=kld)


def _finish(count: int, is_bool: bool, acc: Acc, kld: Kld | None) -> TensorDiff:
    reasons: list[str] = []
    out = _nan_metrics()
    tstats = _stats(acc.sx, acc.sxx, count - acc.nonfin_x)
    bstats = _stats(acc.sy, acc.syy, count - acc.nonfin_y)
    diff = TensorDiff(out, acc.bitwise, count, acc.differ, acc.first_diff, None, acc.mismatch, "",
                      tstats, bstats)
    if acc.mismatch:
        diff.fail_reason = REASON_NONFINITE
        return diff
    sxx, syy, sxy = math.fsum(acc.sxx), math.fsum(acc.syy), math.fsum(acc.sxy)
    sdd, sad, srel = math.fsum(acc.sdd), math.fsum(acc.sad), math.fsum(acc.srel)
    nx, ny = math.sqrt(sxx), math.sqrt(syy)
    if count == 1:
        cos = 1.0
        reasons.append(REASON_SCALAR)
    elif nx <= EPS and ny < EPS:
        cos = 1.0
    elif nx <= EPS or ny <= EPS:
        cos = math.nan
        reasons.append(REASON_ZERO_X if nx <= EPS else REASON_ZERO_Y)
    else:
        den = math.sqrt(sxx * syy)  # exact for identical sides (sqrt(q²) == q), unlike nx·ny
        cos = max(-1.0, min(1.0, sxy / (den if math.isfinite(den) else nx * ny)))
    out["CosineSimilarity"] = cos
    out["RelativeEuclideanDistance"] = 0.0 if ny <= EPS else math.sqrt(sdd) / ny
    out["OneThousandthErrRatio"] = acc.c1 / count
    out["FiveThousandthsErrRatio"] = acc.c5 / count
    if not is_bool:
        out["MaxAbsoluteError"] = acc.mad
        out["AccumulatedRelativeError"] = srel
        out["MeanAbsoluteError"] = sad / count
        out["RootMeanSquareError"] = math.sqrt(sdd / count)
        out["MaxRelativeError"] = acc.mrel
        out["MeanRelativeError"] = srel / count
        if sxx == 0.0 or syy == 0.0:
            out["KullbackLeiblerDivergence"] = math.nan
        else:  # no KLD terms: every block bitwise identical
            out["KullbackLeiblerDivergence"] = 0.0 if kld is None else kld.value()
        diff.max_abs_index = acc.mad_idx if acc.mad > 0 else None
    diff.fail_reason = " ".join(reasons)
    return diff


# -- statistics mode ---------------------------------------------------------------------------
_STAT_FIELDS = (("Max", "max"), ("Min", "min"), ("Mean", "mean"), ("Norm", "l2norm"))


def _stat_pair(t: float | None, b: float | None) -> tuple[float, float, bool]:
    """(diff, relative error as a fraction, same) of one statistic, by msprobe's rules."""
    if t is None or b is None:
        return math.nan, math.nan, t is None and b is None
    if t == b or (math.isnan(t) and math.isnan(b)):
        return 0.0, 0.0, True
    d = t - b                     # ±inf and NaN fall out of IEEE arithmetic as msprobe's rules say
    if math.isnan(d):
        return d, math.nan, False
    if math.isinf(d) or b == 0:
        return d, math.inf, False  # msprobe prints -inf for a -inf side; a magnitude is |…|
    return d, abs(d / b), False


def compare_stats(target: TensorStats, bench: TensorStats) -> StatsDiff:
    """Statistics-mode comparison (msprobe "statistics" level: Max/Min/Mean/Norm only).

    ``*Diff`` = target − bench; ``*RelativeErr`` = |diff / bench| as a *fraction* (msprobe prints
    it ×100 with a '%'), 0 for equal values, inf when bench is 0 or the diff is infinite, NaN when
    exactly one side is NaN or a statistic is missing. Unlike msprobe, NaN/Inf seen on only one
    side (from the NaN/Inf counts) makes the pair unequal even if the four numbers agree."""
    diffs: dict[str, float] = {}
    equal = True
    for label, attr in _STAT_FIELDS:
        d, rel, same = _stat_pair(getattr(target, attr), getattr(bench, attr))
        diffs[f"{label}Diff"] = d
        diffs[f"{label}RelativeErr"] = rel
        equal = equal and same
    reasons = []
    if tuple(target.shape) != tuple(bench.shape):
        reasons.append(f"Tensor shapes do not match: {tuple(target.shape)} vs {tuple(bench.shape)}.")
        equal = False
    flags = [(s.nan > 0, s.pos_inf > 0, s.neg_inf > 0) for s in (target, bench)]
    if flags[0] != flags[1]:
        reasons.append(REASON_NONFINITE)
        equal = False
    if all(getattr(s, a) is None for s in (target, bench) for _, a in _STAT_FIELDS):
        reasons.append("No statistics on either side.")
    return StatsDiff(diffs, equal, " ".join(reasons))
