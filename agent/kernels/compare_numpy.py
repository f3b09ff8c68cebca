"""The block kernels behind :func:`.metrics.compare_arrays`: numpy calls on block-sized
float64 buffers, rewritten in place, and BLAS dots kept on the calling thread.

Why the shapes below: numpy has no fused loop, so the cost is the number of passes over a
block (~0.1–0.25 ns per element each) plus ~0.5–1 µs of Python per call; 128K-element blocks
keep three float64 buffers (3 MiB) in L2/L3 and make the per-call overhead negligible. Sums of
products go through BLAS ``ddot`` (vecdot over rows of 8192), the one float64 reduction numpy
offers that multiplies and adds in one pass. bench/README.md has the per-pass table.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Iterator

from .lazy import np   # numpy on first use (kernels/lazy.py)

from ..health import beat
from ..safeio import mapped_pages

Range = tuple[float, float]
_RELEASE_BYTES = 32 << 20   # mapped pages dropped from the RSS about this often

RATIO_THRESHOLDS: tuple[float, float] = (0.001, 0.005)
EPS = 2.0 ** -52     # float64's eps (np.finfo(float).eps), written out: no numpy import for it
EPS32 = 2.0 ** -23   # float32's

# float32 holds these exactly: their values are compared after the cast; others in their own dtype
_EXACT_IN_F32 = {"b1", "i1", "u1", "i2", "u2", "f2", "f4"}


class Side:
    """One operand: a native-endian array view (bfloat16 as uint16 words) and how to widen it."""

    __slots__ = ("a", "bf16", "code", "exact")

    def __init__(self, a: np.ndarray, dtype: str | None) -> None:
        a = np.asarray(a)  # a memmap becomes a plain view: no copy
        # dtype.name is a slow Python property: asked only of dtypes numpy does not define
        self.bf16 = dtype == "bfloat16" or (a.dtype.kind not in "biuf" and a.dtype.name == "bfloat16")
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


class Scratch:
    """Buffers of one block, allocated once per compare: three float64 rows (x, y, |x−y|, each
    rewritten in place once read), two masks, and float32/uint32/int16 words for narrowing,
    bfloat16 and 16-bit float ranges, made only for the sides that need them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.x, self.y, self.z = (np.empty(n) for _ in range(3))
        self.b1, self.b2 = np.empty(n, np.bool_), np.empty(n, np.bool_)
        self.f32: np.ndarray | None = None
        self.u32: np.ndarray | None = None
        self.i16: np.ndarray | None = None


_kept = threading.local()


def scratch(n: int) -> Scratch:
    """Block buffers of at least ``n`` elements, kept per thread from one compare to the next
    (at most one block's worth: 3.25 MiB at the default size). Fresh buffers cost a page fault
    per 4 KiB on first write, ~2.5 ns per float64 element here: more than the passes themselves,
    so a 100K-element tensor spent most of its compare faulting in new memory."""
    sc = getattr(_kept, "sc", None)
    if sc is None or sc.n < n:
        sc = _kept.sc = Scratch(n)
    return sc


def drop_scratch() -> None:
    """Let this thread's kept buffers go (to measure a compare's own allocations, or to free
    them after a large comparison)."""
    _kept.sc = None


def _widen(side: Side, raw: np.ndarray, out: np.ndarray, sc: Scratch) -> None:
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


def pairs(x: np.ndarray, y: np.ndarray, n: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Aligned 1-D chunks (offset, x chunk, y chunk) of at most n elements, in C order. Pages of
    a memory-mapped side are dropped from the RSS behind the pass (``mapped_pages``), so
    comparing a tensor of any size keeps the RSS bounded."""
    if x.flags.c_contiguous and y.flags.c_contiguous:
        fx, fy = x.reshape(-1), y.reshape(-1)
        rel = [(r, f.itemsize) for f in (fx, fy) if (r := mapped_pages(f)) is not None]
        done = 0
        for i in range(0, fx.size, n):
            yield i, fx[i:i + n], fy[i:i + n]
            if rel and (i + n - done) * fx.itemsize >= _RELEASE_BYTES:
                for r, isz in rel:
                    r(done * isz, (i + n) * isz)
                done = i + n
                beat()
        for r, isz in rel:
            r(done * isz, fx.size * isz)
        return
    it = np.nditer([x, y], flags=["external_loop", "buffered", "zerosize_ok"],
                   op_flags=[["readonly"], ["readonly"]], order="C", buffersize=n)
    off = 0
    for cx, cy in it:
        yield off, cx, cy
        off += cx.size


class Acc:
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
        # identical blocks met before the KLD normalisation was known: (offset, size, Σx)
        self.kld_todo: list[tuple[int, int, float]] = []


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """Σab in float64 (products of float32 values are exact) through BLAS, in rows of _ROW
    elements: OpenBLAS hands a longer dot to its thread pool, whose threads spin on a busy host
    (a 10001-element dot measured 60× slower per element than a 10000-element one, and it takes
    a second core from training); one vecdot call for all rows keeps the Python overhead low.
    Half the passes of multiply-then-sum; float64 accumulation, error ~1e-16 relative. (Plain
    sums stay ``np.add.reduce``: a dot with ones measured no faster inside the block pass.)"""
    n = a.size
    k = n // _ROW
    e = k * _ROW
    s = 0.0
    if k:
        s = float(np.add.reduce(_rowdot(a[:e].reshape(k, _ROW), b[:e].reshape(k, _ROW)), axis=None))
    if e < n:
        s += float(np.dot(a[e:], b[e:]))
    return s


def _rowdot_loop(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """numpy < 2.0 (no vecdot): one ``np.dot`` per row, each below the threading size."""
    return np.array([np.dot(p, q) for p, q in zip(a, b)])


def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise dots: ``np.vecdot`` (numpy >= 2.0), else one ``np.dot`` per row (chosen on the
    first call: numpy is imported lazily)."""
    global _rowdot
    _rowdot = getattr(np, "vecdot", None) or _rowdot_loop
    return _rowdot(a, b)


def _zero_nonfinite(v: np.ndarray) -> int:
    bad = ~np.isfinite(v)
    k = int(np.count_nonzero(bad))
    v[bad] = 0.0
    return k


def _half_range(side: Side, raw: np.ndarray, sc: Scratch) -> tuple[float, float]:
    """(min, max) of a block of 16-bit floats (half or bfloat16) from their words: numpy's half
    arithmetic runs ~5 ns per element, but sign-magnitude words map to an order-preserving int16
    key (flip the magnitude bits of negatives) in three cheap integer passes. NaN sorts beyond
    ±Inf, so a NaN or Inf in the block shows as a non-finite extreme."""
    w = (raw if raw.dtype.isnative else raw.astype(raw.dtype.newbyteorder("="))).view(np.int16)
    if sc.i16 is None:
        sc.i16 = np.empty(sc.n, np.int16)
    k = sc.i16[:w.size]
    np.right_shift(w, 15, out=k)
    np.bitwise_and(k, 0x7FFF, out=k)
    np.bitwise_xor(k, w, out=k)
    ends = np.array([np.minimum.reduce(k), np.maximum.reduce(k)], np.int16)
    ends ^= (ends >> 15) & 0x7FFF               # the same flip maps a key back to its word
    if side.bf16:
        vals = (ends.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        vals = ends.view(np.float16)
    return float(vals[0]), float(vals[1])


def _block_range(side: Side, raw: np.ndarray, sc: Scratch) -> tuple[float, float]:
    """(min, max) of one block's float32 values, NaN/Inf counted as 0 as pass 1 zeroes them.
    Rounding to float32 is monotonic, so the raw extremes, rounded, are the rounded extremes."""
    if side.bf16 or side.code == "f2":
        lo, hi = _half_range(side, raw, sc)
    else:
        lo, hi = np.minimum.reduce(raw), np.maximum.reduce(raw)
        if not side.exact:
            lo, hi = np.float32(lo), np.float32(hi)   # beyond float32's range: inf, handled below
    if math.isfinite(lo) and math.isfinite(hi):
        return float(lo), float(hi)
    v = sc.z[:raw.size]
    _widen(side, raw, v, sc)
    _zero_nonfinite(v)
    return float(np.minimum.reduce(v)), float(np.maximum.reduce(v))


class Kld:
    """KLD = T/Sa + log(Sb/Sa), T = Σ a·log(a/b), a and b the clamped min-max values, summed
    block by block in pass 1 once a range pre-pass has found both sides' extremes.

    With u = x − min_x (v likewise) and s = 1/(max − min), a = s_x·u wherever no element of a
    block falls under the float32-eps clamp (known from the block minima of the pre-pass), so
    Σ a·log(a/b) = s_x·(Σ u·log(u/v) + Σu·log(s_x/s_y)): no scaling or clamping per element,
    one divide, one log, one dot. Blocks that reach the clamp take the literal definition."""

    def __init__(self, sx_: Side, sy_: Side, x: np.ndarray, y: np.ndarray, n: int, sc: Scratch,
                 c_range: Callable[[Side, np.ndarray], Range | None] | None = None,
                 ranges: dict[int, tuple[Range, Range]] | None = None) -> None:
        """``ranges``: each block's ((min, max) of x, of y) if known, else a pre-pass finds them."""
        mn, mx = [math.inf, math.inf], [-math.inf, -math.inf]
        self.bmin: dict[int, tuple[float, float]] = {}
        if ranges is None:
            ranges = {}
            for off, xr, yr in pairs(x, y, n):   # c_range: the C kernel's range of a block, if it can
                rx, ry = (c_range(sx_, xr), c_range(sy_, yr)) if c_range is not None else (None, None)
                ranges[off] = (rx or _block_range(sx_, xr, sc), ry or _block_range(sy_, yr, sc))
        for off, ((lx, hx), (ly, hy)) in ranges.items():
            self.bmin[off] = (lx, ly)
            mn[0], mn[1], mx[0], mx[1] = min(mn[0], lx), min(mn[1], ly), max(mx[0], hx), max(mx[1], hy)
        self.shift, self.scale = [0.0, 0.0], [1.0, 1.0]
        for k in (0, 1):
            if mx[k] > mn[k]:  # a constant side is left as is
                self.shift[k], self.scale[k] = mn[k], 1.0 / (mx[k] - mn[k])
        self.log_s = math.log(self.scale[0] / self.scale[1])
        self.mag = [max(abs(mn[k]), abs(mx[k])) for k in (0, 1)]
        self.same_norm = self.shift[0] == self.shift[1] and self.scale[0] == self.scale[1]
        self.sa: list[float] = []
        self.sb: list[float] = []
        self.t: list[float] = []
        self.ca: list[float] = []   # the C kernel's blocks: Σa, Σb, G of the near terms,
        self.cb: list[float] = []   # Σ a·log(a/b), Σa, Σb of the far ones
        self.g: list[float] = []
        self.far: list[tuple[float, float, float]] = []

    def params(self, off: int) -> tuple[float, float, float, float, bool]:
        """(shift, scale) of each side and whether block ``off`` may reach the clamp, as the C
        kernel takes them (it skips the clamp where it cannot bite)."""
        return self.shift[0], self.scale[0], self.shift[1], self.scale[1], self._clamps(off)

    def add_g(self, sa: float, sb: float, g: float, tf: float, pf: float, qf: float) -> None:
        """One block's partials from the C kernel: over the terms its series takes, Σa, Σb and
        G = Σ a·log(a/b) − Σa + Σb, whose terms b·g(w) >= 0 are second order in a − b (see
        kernels/compare.c): no cancellation in G; over the others, Σ a·log(a/b), Σa and Σb."""
        self.ca.append(sa), self.cb.append(sb), self.g.append(g)
        if tf or pf or qf:
            self.far.append((tf, pf, qf))

    def _clamps(self, off: int) -> bool:
        lx, ly = self.bmin[off]
        return (lx - self.shift[0]) * self.scale[0] < 2 * EPS32 or (ly - self.shift[1]) * self.scale[1] < 2 * EPS32

    def _shifted_sum(self, k: int, s: float, m: int) -> float | None:
        """Σ(v − min_v) of a block from its Σv, where cancellation costs at most ~1e-12 of it
        (so of KLD): pairwise Σv errs by < ~35·2⁻⁵³·m·max|v|, so Σ(v − min) must reach
        3e-3·m·max|v|. Zero-centred data passes; data like 16 ± 0.01 sums v − min (None)."""
        s_u = s - m * self.shift[k]
        return s_u if s_u >= 3e-3 * m * self.mag[k] else None

    def block(self, off: int, a: np.ndarray, b: np.ndarray, w: np.ndarray, s_x: float,
              s_y: float) -> None:
        """One block's terms from its x values ``a`` and y values ``b`` (sums ``s_x``, ``s_y``);
        ``a`` and ``w`` are overwritten, ``b`` is kept."""
        sh, sc, m = self.shift, self.scale, a.size
        if self._clamps(off):
            for v, k, dst in ((a, 0, a), (b, 1, w)):
                np.subtract(v, sh[k], out=dst)
                np.multiply(dst, sc[k], out=dst)
                np.maximum(dst, EPS32, out=dst)
            self.sa.append(float(np.add.reduce(a)))
            self.sb.append(float(np.add.reduce(w)))
            self.t.append(dot(a, np.log(np.divide(a, w, out=w), out=w)))
            return
        u, v = np.subtract(a, sh[0], out=a), np.subtract(b, sh[1], out=w)
        s_u, s_v = self._shifted_sum(0, s_x, m), self._shifted_sum(1, s_y, m)
        if s_u is None:
            s_u = float(np.add.reduce(u))
        if s_v is None:
            s_v = float(np.add.reduce(v))
        t_u = dot(u, np.log(np.divide(u, v, out=v), out=v))
        self.sa.append(sc[0] * s_u), self.sb.append(sc[1] * s_v)
        self.t.append(sc[0] * (t_u + s_u * self.log_s))

    def totals(self, off: int, m: int, s_x: float, s_y: float) -> tuple[float, float] | None:
        """(Σa, Σb) of a block that does not reach the clamp, from its Σx and Σy (pass 1's) where
        cancellation allows, so that the C kernel's pass 2 need not sum them; else None."""
        if self._clamps(off):
            return None
        s_u, s_v = self._shifted_sum(0, s_x, m), self._shifted_sum(1, s_y, m)
        if s_u is None or s_v is None:
            return None
        return self.scale[0] * s_u, self.scale[1] * s_v

    def same_free(self, off: int, m: int, s: float) -> bool:
        """Add the terms of a block equal on both sides from its size and Σx alone, if it can:
        with one normalisation a == b there, so log(a/b) = 0 and only Σa counts."""
        s_u = self._shifted_sum(0, s, m) if self.same_norm and not self._clamps(off) else None
        if s_u is None:
            return False
        self.sa.append(self.scale[0] * s_u), self.sb.append(self.scale[0] * s_u)
        return True

    def same_block(self, off: int, a: np.ndarray, b: np.ndarray, w: np.ndarray, s: float) -> None:
        """A block whose values ``a`` (sum ``s``) are equal on both sides (``b``, ``w``: spare)."""
        if not self.same_free(off, a.size, s):
            np.copyto(b, a)
            self.block(off, a, b, w, s, s)

    def value(self) -> float:
        """T/Sa + log(Sb/Sa). With C blocks and e = (Sb − Sa)/Sa small (close sides),
        (G + Σ numpy blocks' T − Σa + Σb)/Sa + log1p(e) − e instead: the first-order parts of
        T and of log(Sb/Sa), which cancel, are left out of both. Where e is not small, G and e
        grow alike (a far term's b·g(w) nears b as a/b nears 0) and would cancel: there T is
        summed from the near terms' G + Σa − Σb and the far terms' Σ a·log(a/b)."""
        tf, pf, qf = (list(v) for v in zip(*self.far)) if self.far else ([], [], [])
        s_a, s_b = math.fsum(self.sa + self.ca + pf), math.fsum(self.sb + self.cb + qf)
        e = math.fsum(self.sb + self.cb + qf + [-v for v in self.sa + self.ca + pf]) / s_a
        if not self.g or abs(e) >= 0.5:
            t = math.fsum(self.t + self.g + self.ca + [-v for v in self.cb] + tf)
            kld = t / s_a + math.log(s_b / s_a)
        else:
            g = math.fsum(self.g + self.t + self.sb + [-v for v in self.sa] + tf + qf + [-v for v in pf])
            kld = g / s_a + (math.log1p(e) - e)
        return 0.0 if abs(kld) < EPS else kld


def general_block(sx_: Side, sy_: Side, xr: np.ndarray, yr: np.ndarray, off: int, acc: Acc,
                  sc: Scratch, kld: Kld | None) -> None:
    """Every metric's partials for one block in three float64 buffers rewritten in place
    (z: x−y, |x−y|, the relative error, then KLD's y − min_y; x: x − min_x): ~30 numpy calls
    on block-sized arrays, no temporaries."""
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
    acc.sxx.append(dot(x, x)), acc.syy.append(dot(y, y)), acc.sxy.append(dot(x, y))
    d = np.subtract(x, y, out=z)  # exact: float32 values, float64 difference
    acc.sdd.append(dot(d, d))
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
        kld.block(off, x, y, z, s_x, s_y)


def same_bytes(xr: np.ndarray, yr: np.ndarray, uview: np.dtype, buf: np.ndarray) -> bool:
    """Bitwise equality of two blocks, compared as 8-byte words where the length allows."""
    if xr.nbytes % 8 == 0 and xr.flags.c_contiguous and yr.flags.c_contiguous:
        uview = np.dtype(np.uint64)
    a, b = xr.view(uview), yr.view(uview)
    return not np.not_equal(a, b, out=buf[:a.size]).any()
