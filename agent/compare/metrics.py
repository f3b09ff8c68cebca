"""How far one tensor is from its benchmark: msaccucmp's metric columns, msprobe's error ratios
and bitwise equality, in one chunked pass (a second pass only for KLD, only when they differ).

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
-0.0 == 0.0). Memory: a few block-sized float64 scratch arrays (``block_elems``, default 32768),
whatever the tensor size; a memmap is read block by block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..model import TensorStats

METRIC_NAMES: tuple[str, ...] = (
    "CosineSimilarity", "MaxAbsoluteError", "AccumulatedRelativeError", "RelativeEuclideanDistance",
    "KullbackLeiblerDivergence", "MeanAbsoluteError", "RootMeanSquareError", "MaxRelativeError",
    "MeanRelativeError")
RATIO_NAMES: tuple[str, ...] = ("OneThousandthErrRatio", "FiveThousandthsErrRatio")
RATIO_THRESHOLDS: tuple[float, float] = (0.001, 0.005)
BOOL_METRICS = ("CosineSimilarity", "RelativeEuclideanDistance")

EPS = float(np.finfo(float).eps)
EPS32 = float(np.finfo(np.float32).eps)
DEFAULT_BLOCK = 1 << 17

REASON_SCALAR = "this tensor is scalar."
REASON_EMPTY = "this tensor is empty."
REASON_NONFINITE = "The position of inf or nan in NPU and golden tensor do not match."
REASON_ZERO_X = "Cannot compare by Cosine Similarity. All the data is zero in NPU dump data."
REASON_ZERO_Y = "Cannot compare by Cosine Similarity. All the data is zero in golden dump data."

# float32 holds these exactly: their values are compared after the cast; others in their own dtype
_EXACT_IN_F32 = {"b1", "i1", "u1", "i2", "u2", "f2", "f4"}


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


class _Side:
    """One operand: a native-endian array view (bfloat16 as uint16 words) and how to widen it."""

    __slots__ = ("a", "bf16", "code", "exact")

    def __init__(self, a: np.ndarray, dtype: str | None) -> None:
        a = np.asarray(a)  # a memmap becomes a plain view: no copy
        self.bf16 = dtype == "bfloat16" or a.dtype.name == "bfloat16"
        if self.bf16:
            if a.dtype.itemsize != 2:
                raise TypeError(f"bfloat16 data must come as 16-bit words, got {a.dtype}")
            a = a.view(np.dtype(np.uint16).newbyteorder(a.dtype.byteorder))
        elif a.dtype.kind not in "biuf":
            raise TypeError(f"cannot compare dtype {a.dtype}")
        self.a = a
        self.code = "bf16" if self.bf16 else f"{a.dtype.kind}{a.dtype.itemsize}"
        self.exact = self.bf16 or self.code in _EXACT_IN_F32

    @property
    def name(self) -> str:
        return "bfloat16" if self.bf16 else self.a.dtype.name


_ROW = 8192  # elements per BLAS dot call: OpenBLAS hands a dot of > 10000 elements to its threads


class _Scratch:
    """Buffers of one block, allocated once per compare: three float64 rows (x, y, |x−y|, each
    rewritten in place once read), two masks, and float32/uint32 words for narrowing and
    bfloat16, made only for the sides that need them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.x, self.y, self.z = (np.empty(n) for _ in range(3))
        self.b1, self.b2 = np.empty(n, np.bool_), np.empty(n, np.bool_)
        self.f32: np.ndarray | None = None
        self.u32: np.ndarray | None = None


def _widen(side: _Side, raw: np.ndarray, out: np.ndarray, sc: _Scratch) -> None:
    """The float32 values of ``raw``, widened to float64 into ``out``."""
    if not raw.dtype.isnative:
        raw = raw.astype(raw.dtype.newbyteorder("="))
    if side.bf16:
        if sc.u32 is None:
            sc.u32 = np.empty(sc.n, np.uint32)
        u = sc.u32[:raw.size]
        np.copyto(u, raw)
        np.left_shift(u, 16, out=u)
        np.copyto(out, u.view(np.float32))
    elif side.exact:
        np.copyto(out, raw, casting="unsafe")
    else:  # float64, wide ints: round to float32 first, as msaccucmp does
        if sc.f32 is None:
            sc.f32 = np.empty(sc.n, np.float32)
        f = sc.f32[:raw.size]
        np.copyto(f, raw, casting="unsafe")
        np.copyto(out, f)


def _pairs(x: np.ndarray, y: np.ndarray, n: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Aligned 1-D chunks (offset, x chunk, y chunk) of at most n elements, in C order."""
    if x.flags.c_contiguous and y.flags.c_contiguous:
        fx, fy = x.reshape(-1), y.reshape(-1)
        for i in range(0, fx.size, n):
            yield i, fx[i:i + n], fy[i:i + n]
        return
    it = np.nditer([x, y], flags=["external_loop", "buffered", "zerosize_ok"],
                   op_flags=[["readonly"], ["readonly"]], order="C", buffersize=n)
    off = 0
    for cx, cy in it:
        yield off, cx, cy
        off += cx.size


class _Acc:
    """Block partials (Python floats) of one pass."""

    def __init__(self) -> None:
        self.sx: list[float] = []
        self.sy: list[float] = []
        self.sxx: list[float] = []
        self.syy: list[float] = []
        self.sxy: list[float] = []
        self.sdd: list[float] = []
        self.sad: list[float] = []
        self.srel: list[float] = []
        self.mad = 0.0
        self.mad_idx: int | None = None
        self.mrel = 0.0
        self.c1 = self.c5 = self.differ = self.mismatch = self.nonfin_x = self.nonfin_y = 0
        self.first_diff: int | None = None
        self.bitwise = True
        self.dirty: set[int] = set()   # offsets of blocks holding NaN/Inf (zeroed again in revisits)
        self.kld_todo: list[int] = []  # identical blocks met before the KLD normalisation was known


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """Σab in float64 (products of float32 values are exact) through BLAS, in rows of _ROW
    elements: OpenBLAS hands a longer dot to its thread pool, whose threads spin on a busy host
    (30× slower here, and a second core taken from training); one call for all rows keeps the
    Python overhead per block low. Row sums are pairwise-accurate to ~1e-16, far below 1e-6."""
    n = a.size
    k = n // _ROW
    e = k * _ROW
    s = 0.0
    if k:
        s = float(np.add.reduce(_rowdot(a[:e].reshape(k, _ROW), b[:e].reshape(k, _ROW)), axis=None))
    if e < n:
        s += float(np.dot(a[e:], b[e:]))
    return s


def _rowdot_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.matmul(a[:, None, :], b[:, :, None])


_rowdot = getattr(np, "vecdot", None) or _rowdot_matmul   # numpy >= 2.0 has vecdot


def _zero_nonfinite(v: np.ndarray) -> int:
    bad = ~np.isfinite(v)
    k = int(np.count_nonzero(bad))
    v[bad] = 0.0
    return k


def _block_range(side: _Side, raw: np.ndarray, sc: _Scratch) -> tuple[float, float]:
    """(min, max) of one block's float32 values, NaN/Inf counted as 0 as pass 1 zeroes them.
    Rounding to float32 is monotonic, so the raw extremes, rounded, are the rounded extremes."""
    if not side.bf16:
        lo, hi = np.minimum.reduce(raw), np.maximum.reduce(raw)
        if not side.exact:
            lo, hi = np.float32(lo), np.float32(hi)   # beyond float32's range: inf, handled below
        if math.isfinite(lo) and math.isfinite(hi):
            return float(lo), float(hi)
    v = sc.z[:raw.size]
    _widen(side, raw, v, sc)
    _zero_nonfinite(v)
    return float(np.minimum.reduce(v)), float(np.maximum.reduce(v))


class _Kld:
    """KLD = T/Sa + log(Sb/Sa), T = Σ a·log(a/b), a and b the clamped min-max values, summed
    block by block in pass 1 once a range pre-pass has found both sides' extremes.

    With u = x − min_x (v likewise) and s = 1/(max − min), a = s_x·u wherever no element of a
    block falls under the float32-eps clamp (known from the block minima of the pre-pass), so
    Σ a·log(a/b) = s_x·(Σ u·log(u/v) + Σu·log(s_x/s_y)): no scaling or clamping per element,
    one divide, one log, one dot. Blocks that reach the clamp take the literal definition."""

    def __init__(self, sx_: _Side, sy_: _Side, x: np.ndarray, y: np.ndarray, n: int, sc: _Scratch) -> None:
        mn, mx = [math.inf, math.inf], [-math.inf, -math.inf]
        self.bmin: dict[int, tuple[float, float]] = {}
        for off, xr, yr in _pairs(x, y, n):
            (lx, hx), (ly, hy) = _block_range(sx_, xr, sc), _block_range(sy_, yr, sc)
            self.bmin[off] = (lx, ly)
            mn[0], mn[1], mx[0], mx[1] = min(mn[0], lx), min(mn[1], ly), max(mx[0], hx), max(mx[1], hy)
        self.shift, self.scale = [0.0, 0.0], [1.0, 1.0]
        for k in (0, 1):
            if mx[k] > mn[k]:  # a constant side is left as is
                self.shift[k], self.scale[k] = mn[k], 1.0 / (mx[k] - mn[k])
        self.log_s = math.log(self.scale[0] / self.scale[1])
        self.same_norm = self.shift[0] == self.shift[1] and self.scale[0] == self.scale[1]
        self.sa: list[float] = []
        self.sb: list[float] = []
        self.t: list[float] = []

    def _clamps(self, off: int) -> bool:
        lx, ly = self.bmin[off]
        return (lx - self.shift[0]) * self.scale[0] < 2 * EPS32 or (ly - self.shift[1]) * self.scale[1] < 2 * EPS32

    def block(self, off: int, a: np.ndarray, b: np.ndarray, w: np.ndarray) -> None:
        """One block's terms from its x values ``a`` and y values ``b``; ``a`` and ``w`` are
        overwritten, ``b`` is kept."""
        sh, sc = self.shift, self.scale
        if self._clamps(off):
            for v, k, dst in ((a, 0, a), (b, 1, w)):
                np.subtract(v, sh[k], out=dst)
                np.multiply(dst, sc[k], out=dst)
                np.maximum(dst, EPS32, out=dst)
            self.sa.append(float(np.add.reduce(a)))
            self.sb.append(float(np.add.reduce(w)))
            self.t.append(_dot(a, np.log(np.divide(a, w, out=w), out=w)))
            return
        u, v = np.subtract(a, sh[0], out=a), np.subtract(b, sh[1], out=w)
        s_u, s_v = float(np.add.reduce(u)), float(np.add.reduce(v))
        t_u = _dot(u, np.log(np.divide(u, v, out=v), out=v))
        self.sa.append(sc[0] * s_u), self.sb.append(sc[1] * s_v)
        self.t.append(sc[0] * (t_u + s_u * self.log_s))

    def same_block(self, off: int, a: np.ndarray, b: np.ndarray, w: np.ndarray) -> None:
        """A block whose values ``a`` are equal on both sides (``b``, ``w``: spare buffers)."""
        if self.same_norm and not self._clamps(off):  # a == b: log(a/b) = 0, only Σa counts
            s_u = self.scale[0] * float(np.add.reduce(np.subtract(a, self.shift[0], out=a)))
            self.sa.append(s_u), self.sb.append(s_u)
            return
        np.copyto(b, a)
        self.block(off, a, b, w)

    def value(self) -> float:
        s_a, s_b = math.fsum(self.sa), math.fsum(self.sb)
        kld = math.fsum(self.t) / s_a + math.log(s_b / s_a)
        return 0.0 if abs(kld) < EPS else kld


def _identical_block(sx_: _Side, raw: np.ndarray, off: int, acc: _Acc, sc: _Scratch,
                     kld: _Kld | None) -> None:
    """A block whose bytes are equal on both sides: only the norms, sums and KLD terms."""
    m = raw.size
    x = sc.x[:m]
    _widen(sx_, raw, x, sc)
    s = float(np.add.reduce(x))
    if not math.isfinite(s):  # NaN/Inf at the same places on both sides: zeroed, all matched
        k = _zero_nonfinite(x)
        acc.nonfin_x += k
        acc.nonfin_y += k
        acc.dirty.add(off)
        s = float(np.add.reduce(x))
    q = _dot(x, x)
    acc.sx.append(s), acc.sy.append(s)
    acc.sxx.append(q), acc.syy.append(q), acc.sxy.append(q)
    acc.c1 += m
    acc.c5 += m
    if kld is None:
        acc.kld_todo.append(off)  # KLD is 0 unless another block differs; then it is revisited
    else:
        kld.same_block(off, x, sc.y[:m], sc.z[:m])


def _general_block(sx_: _Side, sy_: _Side, xr: np.ndarray, yr: np.ndarray, off: int, acc: _Acc,
                   sc: _Scratch, kld: _Kld | None) -> None:
    """Every metric's partials for one block in three float64 buffers rewritten in place
    (z: |x−y|, then the relative error, then KLD's y−min_y; x: x−min_x): ~30 numpy calls on
    block-sized arrays, no temporaries."""
    m = xr.size
    x, y, z = sc.x[:m], sc.y[:m], sc.z[:m]
    b1, b2 = sc.b1[:m], sc.b2[:m]
    _widen(sx_, xr, x, sc)
    _widen(sy_, yr, y, sc)
    s_x, s_y = float(np.add.reduce(x)), float(np.add.reduce(y))
    dirty = not (math.isfinite(s_x) and math.isfinite(s_y))
    # exact value comparison, in the original precision where float32 would round (two native
    # float32 blocks compare as they are: half the bytes of their float64 copies)
    if sx_.code == sy_.code == "f4" and xr.dtype.isnative and yr.dtype.isnative:
        vx, vy = xr, yr
    else:
        vx = x if sx_.exact else (xr if xr.dtype.isnative else xr.astype(xr.dtype.newbyteorder("=")))
        vy = y if sy_.exact else (yr if yr.dtype.isnative else yr.astype(yr.dtype.newbyteorder("=")))
    ne = np.not_equal(vx, vy, out=b1)
    if dirty:
        ne &= ~(np.isnan(vx) & np.isnan(vy))
    nd = int(np.count_nonzero(ne))
    if nd:
        acc.differ += nd
        if acc.first_diff is None:
            acc.first_diff = off + int(np.argmax(ne))
    if dirty:
        acc.dirty.add(off)
        fx, fy = np.isfinite(x), np.isfinite(y)
        same = (np.isnan(x) & np.isnan(y)) | (x == y)
        acc.mismatch += int(np.count_nonzero(~(fx & fy) & ~same))
        acc.nonfin_x += _zero_nonfinite(x)
        acc.nonfin_y += _zero_nonfinite(y)
        s_x, s_y = float(np.add.reduce(x)), float(np.add.reduce(y))
    acc.sx.append(s_x), acc.sy.append(s_y)
    acc.sxx.append(_dot(x, x)), acc.syy.append(_dot(y, y)), acc.sxy.append(_dot(x, y))
    d = np.subtract(x, y, out=z)  # exact: float32 values, float64 difference
    acc.sdd.append(_dot(d, d))
    np.abs(d, out=d)
    acc.sad.append(float(np.add.reduce(d)))
    top = float(np.maximum.reduce(d))
    if top > acc.mad:  # the first block to reach a new maximum keeps the first index
        acc.mad, acc.mad_idx = top, off + int(np.argmax(d))
    small = np.less_equal(y, EPS, out=b2)  # |y| <= eps, without a buffer for |y|
    small &= np.greater_equal(y, -EPS, out=b1)
    ns = int(np.count_nonzero(small))
    if ns:
        idx = np.flatnonzero(small)
        zx = d[idx][y[idx] == 0] / EPS   # |x| / eps where y == 0: msprobe adds eps to both sides
        acc.c1 += int(np.count_nonzero(zx < RATIO_THRESHOLDS[0]))
        acc.c5 += int(np.count_nonzero(zx < RATIO_THRESHOLDS[1]))
    r = np.abs(np.divide(d, y, out=d), out=d)  # |x−y|/|y|; y == 0: inf or nan, not "below"
    acc.c1 += int(np.count_nonzero(np.less(r, RATIO_THRESHOLDS[0], out=b1)))
    acc.c5 += int(np.count_nonzero(np.less(r, RATIO_THRESHOLDS[1], out=b1)))
    if ns:
        r[idx] = 0.0  # msaccucmp: |y| <= eps contributes 0
    acc.srel.append(float(np.add.reduce(r)))
    acc.mrel = max(acc.mrel, float(np.maximum.reduce(r)))
    if kld is not None:
        kld.block(off, x, y, z)


def _revisit(sx_: _Side, x: np.ndarray, y: np.ndarray, n: int, acc: _Acc, sc: _Scratch, kld: _Kld) -> None:
    """KLD terms of the identical blocks met before the first differing one."""
    todo = set(acc.kld_todo)
    for off, xr, _ in _pairs(x, y, n):
        if off in todo:
            m = xr.size
            a = sc.x[:m]
            _widen(sx_, xr, a, sc)
            if off in acc.dirty:
                _zero_nonfinite(a)
            kld.same_block(off, a, sc.y[:m], sc.z[:m])


def _stats(s: list[float], q: list[float], n: int) -> tuple[float, float] | None:
    if n <= 0:
        return None
    mean = math.fsum(s) / n
    return mean, math.sqrt(max(math.fsum(q) / n - mean * mean, 0.0))


def _failed(reason: str, bitwise: bool = False, count: int = 0) -> TensorDiff:
    return TensorDiff(_nan_metrics(), bitwise, count, 0, None, None, 0, reason)


def _same_bytes(xr: np.ndarray, yr: np.ndarray, uview: np.dtype, buf: np.ndarray) -> bool:
    """Bitwise equality of two blocks, compared as 8-byte words where the length allows."""
    if xr.nbytes % 8 == 0 and xr.flags.c_contiguous and yr.flags.c_contiguous:
        uview = np.dtype(np.uint64)
    a, b = xr.view(uview), yr.view(uview)
    return not np.not_equal(a, b, out=buf[:a.size]).any()


def compare_arrays(target: np.ndarray, bench: np.ndarray, *, target_dtype: str | None = None,
                   bench_dtype: str | None = None, block_elems: int = DEFAULT_BLOCK) -> TensorDiff:
    """Compare ``target`` (NPU / "my" side) with ``bench`` (golden side); see the module docstring.

    ``*_dtype="bfloat16"``: that array holds raw bfloat16 words (uint16), converted per block.
    Never raises on bad data: an unsupported dtype or a shape mismatch is a ``fail_reason``."""
    try:
        sx_, sy_ = _Side(target, target_dtype), _Side(bench, bench_dtype)
    except TypeError as e:
        return _failed(str(e))
    x, y = sx_.a, sy_.a
    if x.shape != y.shape:
        return _failed(f"Shape of NPU and golden tensor do not match: {x.shape} vs {y.shape}.")
    same_dtype = sx_.code == sy_.code and x.dtype == y.dtype
    if x.size == 0:
        return _failed(REASON_EMPTY, bitwise=same_dtype)
    n = max(1, int(block_elems))
    sc = _Scratch(min(n, x.size))
    acc = _Acc()
    acc.bitwise = same_dtype
    uview = np.dtype(f"u{x.dtype.itemsize}") if same_dtype and x.dtype.itemsize in (1, 2, 4, 8) else None
    is_bool = sx_.code == "b1" and sy_.code == "b1"
    kld: _Kld | None = None
    with np.errstate(all="ignore"):
        for off, xr, yr in _pairs(x, y, n):
            if uview is not None and _same_bytes(xr, yr, uview, sc.b1):
                _identical_block(sx_, xr, off, acc, sc, kld)
                continue
            if kld is None and not is_bool:  # the first differing block: KLD needs both ranges
                kld = _Kld(sx_, sy_, x, y, n, sc)
            acc.bitwise = False
            _general_block(sx_, sy_, xr, yr, off, acc, sc, kld)
        if kld is not None and acc.kld_todo:
            _revisit(sx_, x, y, n, acc, sc, kld)
        return _finish(count=int(x.size), is_bool=is_bool, acc=acc, kld=kld)


def _finish(count: int, is_bool: bool, acc: _Acc, kld: _Kld | None) -> TensorDiff:
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
