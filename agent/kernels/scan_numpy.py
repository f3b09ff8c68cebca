"""Per-block kernels of the dump scanner (see scanner.py for the statistics' semantics).

Each kernel folds one 1-D block into a worker's :class:`Acc`, using only the worker's
:class:`Scratch` buffers, so memory stays block-sized whatever the tensor size.
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Callable

from .lazy import np   # numpy on first use (kernels/lazy.py)

FP16_MAX = 65504.0
ROW = 4096                       # BLAS dot length (OpenBLAS threads dots above 10000 elements)
_FAST_LO = 2.0 ** -50            # float32 squares and row sums stay exact-enough in this range
_FAST_HI = 2.0 ** 50


@functools.cache
def _words() -> tuple[Any, Any, Any]:
    """Typed constants of :func:`_widen`, made on first use (numpy is imported lazily)."""
    return (np.float32(2.0 ** 112),       # rebias a half exponent (15) to a single one (127)
            np.int32(-1879048193),        # 0x8FFFFFFF: keep the sign, clear sign-extension bits
            np.uint32(0xFFFF0000))


class Acc:
    """Running statistics over blocks (all Python scalars); one per worker thread."""

    __slots__ = ("nan", "pinf", "ninf", "mn", "mx", "sums", "sqs", "abss", "zeros", "finite", "sat")

    def __init__(self) -> None:
        self.nan = self.pinf = self.ninf = self.zeros = self.finite = self.sat = 0
        self.mn: Any = None
        self.mx: Any = None
        self.sums: list[float] = []
        self.sqs: list[float] = []
        self.abss: list[float] = []  # partial sums of |x|, like ``sums``

    def minmax(self, mn: Any, mx: Any) -> None:
        if self.mn is None or mn < self.mn:
            self.mn = mn
        if self.mx is None or mx > self.mx:
            self.mx = mx

    def merge(self, o: "Acc") -> None:
        self.nan += o.nan
        self.pinf += o.pinf
        self.ninf += o.ninf
        self.zeros += o.zeros
        self.finite += o.finite
        self.sat += o.sat
        if o.mn is not None:
            self.minmax(o.mn, o.mx)
        self.sums += o.sums
        self.sqs += o.sqs
        self.abss += o.abss


class Scratch:
    """Block-sized buffers, allocated once per worker and reused for every block."""

    def __init__(self, n: int, row: int) -> None:
        self.n = n
        self.row = row
        self.ones32 = np.ones(row, np.float32)
        self.bools = np.empty(n, np.bool_)
        self._w32: np.ndarray | None = None
        self._f64: np.ndarray | None = None
        # float32 row sums / sums of squares / sums of |x|, reduced in float64 when full (not
        # once per block)
        cap = max(1024, n // row)
        self.rs = np.empty(cap, np.float32)
        self.rq = np.empty(cap, np.float32)
        self.ra = np.empty(cap, np.float32)
        self.used = 0
        # the C kernel's per-worker state and how it reaches the Acc (scan_c.py sets both)
        self.cstate: bytearray | None = None
        self.cflush: Callable[[Acc], None] | None = None

    @property
    def w32(self) -> np.ndarray:
        """4 bytes per element: half words widened to float32 land here."""
        if self._w32 is None:
            self._w32 = np.zeros(self.n, np.uint32)
        return self._w32

    @property
    def f64(self) -> np.ndarray:
        if self._f64 is None:
            self._f64 = np.empty(self.n, np.float64)
        return self._f64

    def flush(self, acc: "Acc") -> None:
        """Move what is pending in scratch (row sums, the C state) into ``acc``."""
        if self.cflush is not None:
            self.cflush(acc)
        if self.used:
            acc.sums.append(float(np.add.reduce(self.rs[:self.used], dtype=np.float64)))
            acc.sqs.append(float(np.add.reduce(self.rq[:self.used], dtype=np.float64)))
            acc.abss.append(float(np.add.reduce(self.ra[:self.used], dtype=np.float64)))
            self.used = 0


# -- sums ---------------------------------------------------------------------------------------
def _exact_sums(x: np.ndarray, acc: Acc, sc: Scratch, mn: Any, mx: Any) -> None:
    """Sum, sum of squares and sum of |x| in float64 (x is converted into scratch unless already
    float64). ``mn``/``mx``: the block's extremes; with one sign, sum |x| is +-sum, no pass."""
    m = x.size
    y = sc.f64[:m]
    if x.dtype != np.float64:
        np.copyto(y, x, casting="unsafe")
        x = y
    s = float(np.add.reduce(x))
    acc.sums.append(s)
    k = m // sc.row * sc.row
    q = float(np.add.reduce(np.vecdot(x[:k].reshape(-1, sc.row), x[:k].reshape(-1, sc.row)))) if k else 0.0
    acc.sqs.append(q + float(np.dot(x[k:], x[k:])))
    if mn >= 0:
        acc.abss.append(s)
    elif mx <= 0:
        acc.abss.append(-s)
    else:
        np.abs(x, out=y)  # x is y, or the caller's float64 block (then y is free scratch)
        acc.abss.append(float(np.add.reduce(y)))


def _rows(b: np.ndarray, acc: Acc, sc: Scratch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block's whole rows as a (k, ROW) view, and the k slots for their sums and squares."""
    k = b.size // sc.row
    if sc.used + k > sc.rs.size:
        sc.flush(acc)
    return b[:k * sc.row].reshape(k, sc.row), sc.rs[sc.used:sc.used + k], sc.rq[sc.used:sc.used + k]


def _f32_sums(b: np.ndarray, mn: float, mx: float, acc: Acc, sc: Scratch, squared: bool = False) -> None:
    """Sums of a finite float32 block: float32 row dots (single-threaded BLAS), rows in float64.
    ``squared``: the rows' sums of squares are already in their slots (``_f32_block``).
    ``b`` may be the scratch ``w32`` itself (widened half words): it is not read after |x|."""
    amax = max(-mn, mx)
    if not (amax == 0.0 or _FAST_LO <= amax <= _FAST_HI):
        _exact_sums(b, acc, sc, mn, mx)
        return
    rows, rs, rq = _rows(b, acc, sc)
    k = len(rows)
    if k * sc.row < b.size:  # first: the |x| below may overwrite b when b is w32
        _exact_sums(b[k * sc.row:], acc, sc, mn, mx)
    if k:
        if not squared:
            np.vecdot(rows, rows, out=rq)
        np.vecdot(rows, sc.ones32, out=rs)
        ra = sc.ra[sc.used:sc.used + k]
        if mn >= 0:
            np.copyto(ra, rs)
        elif mx <= 0:
            np.negative(rs, out=ra)
        else:  # |x| into scratch (in cache: the block was just read), then one more row dot
            a = sc.w32[:k * sc.row].view(np.float32).reshape(k, sc.row)
            np.abs(rows, out=a)
            np.vecdot(a, sc.ones32, out=ra)
        sc.used += k


def _count_zeros(b: np.ndarray, sc: Scratch) -> int:
    bo = sc.bools[:b.size]
    np.equal(b, 0, out=bo)
    return int(np.count_nonzero(bo))


# -- float blocks -------------------------------------------------------------------------------
def _finite_float(b: np.ndarray, acc: Acc, sc: Scratch, mn: Any, mx: Any, fp16: bool = False,
                  squared: bool = False) -> None:
    """A block known to hold finite floats only, with its min and max given."""
    mn, mx = float(mn), float(mx)
    acc.minmax(mn, mx)
    acc.finite += b.size
    acc.zeros += _count_zeros(b, sc)
    amax = max(-mn, mx)
    if b.dtype == np.float32:
        _f32_sums(b, mn, mx, acc, sc, squared)
    else:
        _exact_sums(b, acc, sc, mn, mx)
    if fp16 and amax >= FP16_MAX:
        acc.sat += int(np.count_nonzero(np.abs(b) >= FP16_MAX))


def _float_block(b: np.ndarray, acc: Acc, sc: Scratch, fp16: bool = False) -> None:
    """float32/float64 block (or float16 values widened to float32 exactly)."""
    if b.size == 0:
        return
    mn = np.minimum.reduce(b)
    mx = np.maximum.reduce(b)
    if mn > -np.inf and mx < np.inf:  # NaN fails both comparisons: the block is all finite
        _finite_float(b, acc, sc, mn, mx, fp16)
        return
    # rare path: the block holds NaN or Inf
    nan = int(np.count_nonzero(np.isnan(b)))
    pinf = int(np.count_nonzero(b == np.inf))
    ninf = int(np.count_nonzero(b == -np.inf))
    acc.nan += nan
    acc.pinf += pinf
    acc.ninf += ninf
    if nan + pinf + ninf < b.size:
        f = b[np.isfinite(b)]
        _finite_float(f, acc, sc, np.minimum.reduce(f), np.maximum.reduce(f), fp16)


def _f32_block(b: np.ndarray, acc: Acc, sc: Scratch) -> None:
    """float32 block. The row dots for the squares go first: they stream the block from memory
    faster than numpy's reductions do and leave it in cache for min, max and zeros; their
    results are kept only if the block is finite and within the float32-safe range."""
    if b.size == 0:
        return
    rows, _, rq = _rows(b, acc, sc)
    if len(rows):
        np.vecdot(rows, rows, out=rq)  # may overflow: errstate is set by the caller
    mn = np.minimum.reduce(b)
    mx = np.maximum.reduce(b)
    if mn > -np.inf and mx < np.inf:
        _finite_float(b, acc, sc, mn, mx, squared=True)
    else:
        _float_block(b, acc, sc)


# -- float16 / bfloat16 raw words ---------------------------------------------------------------
class _Half:
    """One 16-bit float format. Its words order like sign-magnitude integers: as int16 the
    largest word is the largest non-negative value, as uint16 the largest is the most negative
    one; 0x0000 is +0 and 0x8000 is -0."""

    def __init__(self, name: str, exp: int) -> None:
        self.name, self.exp = name, exp  # exp: the exponent bits (all ones = Inf/NaN)

    def value(self, word: int) -> float:
        if self.name == "bfloat16":
            return _F32_OF_BITS.unpack(_U32.pack(word << 16))[0]
        return _F16_OF_BITS.unpack(_U16.pack(word))[0]


_U32, _U16 = struct.Struct("=I"), struct.Struct("=H")
_F32_OF_BITS, _F16_OF_BITS = struct.Struct("=f"), struct.Struct("=e")
_F16 = _Half("float16", 0x7C00)
_BF16 = _Half("bfloat16", 0x7F80)
_F16_SAT_WORD = 0x7BFF  # 65504, the largest finite half


def _widen(w: np.ndarray, sc: Scratch, kind: _Half) -> np.ndarray:
    """float32 values of finite words, exact, by integer ops into scratch (numpy's own half
    cast is ~6x slower than these four passes)."""
    m = w.size
    f16_magic, f16_mask, high16 = _words()
    if kind is _BF16:
        u = sc.w32[:m]
        if m % 2 == 0 and w.flags.c_contiguous and w.ctypes.data % 4 == 0:
            # two words as one uint32: one is already in the high half, the other shifts there
            # (values land out of order: the statistics do not care; ~25% fewer bytes moved)
            p = w.view(np.uint32)
            np.bitwise_and(p, high16, out=u[:m // 2])
            np.left_shift(p, 16, out=u[m // 2:])
        else:
            np.copyto(u, w)
            np.left_shift(u, 16, out=u)
        return u.view(np.float32)
    i = sc.w32[:m].view(np.int32)
    np.copyto(i, w.view(np.int16))                 # sign-extends
    np.left_shift(i, 13, out=i)                    # exponent+mantissa into single position
    np.bitwise_and(i, f16_mask, out=i)           # drop the extension bits, keep the sign
    f = i.view(np.float32)
    np.multiply(f, f16_magic, out=f)              # exact: rebias, normalises half subnormals
    return f


def _half_block(w: np.ndarray, acc: Acc, sc: Scratch, kind: _Half) -> None:
    """A block of raw 16-bit words (uint16): integer reductions give the min, the max, the
    NaN/Inf check and whether +0/-0 occur; counting happens only where needed."""
    m = w.size
    if m == 0:
        return
    f = _widen(w, sc, kind)  # first: it streams the words from memory faster than a reduction
    s = w.view(np.int16)
    hs = int(np.maximum.reduce(s))
    hu = int(np.maximum.reduce(w))
    if hs >= kind.exp or (hu & 0x7FFF) >= kind.exp:  # an exponent all ones: NaN/Inf in the block
        if kind is _F16:  # the integer widening turned half NaN/Inf into large finite values
            f = w.view(np.float16).astype(np.float32)
        _float_block(f, acc, sc, fp16=kind is _F16)
        return
    neg, nonneg = hu >= 0x8000, hs >= 0
    lu = int(np.minimum.reduce(w))  # smallest non-negative word or, all negative, nearest 0
    mx = kind.value(hs if nonneg else lu)
    mn = kind.value(hu if neg else lu)
    acc.minmax(mn, mx)
    acc.finite += m
    if lu == 0:                                                  # some +0
        acc.zeros += m - int(np.count_nonzero(w))
    if neg and int(np.minimum.reduce(s)) == -0x8000:            # some -0
        acc.zeros += int(np.count_nonzero(w == 0x8000))
    if kind is _F16 and max(hs if nonneg else 0, (hu & 0x7FFF) if neg else 0) >= _F16_SAT_WORD:
        acc.sat += int(np.count_nonzero((w & 0x7FFF) == _F16_SAT_WORD))
    _f32_sums(f, mn, mx, acc, sc)


# -- integers -----------------------------------------------------------------------------------
def _int_block(b: np.ndarray, acc: Acc, sc: Scratch) -> None:
    m = b.size
    if m == 0:
        return
    if b.dtype == np.bool_:
        b = b.view(np.uint8)
    mn, mx = int(np.minimum.reduce(b)), int(np.maximum.reduce(b))
    acc.minmax(mn, mx)
    _exact_sums(b, acc, sc, mn, mx)
    acc.zeros += m - int(np.count_nonzero(b))
    acc.finite += m


def block_fn(a: np.ndarray, bf16: bool) -> Callable[[np.ndarray, Acc, Scratch], None]:
    """The kernel for ``a``'s dtype (``bf16``: raw bfloat16 words); TypeError when none fits."""
    if bf16:
        return lambda b, acc, sc: _half_block(b, acc, sc, _BF16)
    if a.dtype == np.float16:
        return lambda b, acc, sc: _half_block(b.view(np.uint16), acc, sc, _F16)
    if a.dtype == np.float32:
        return _f32_block
    if a.dtype == np.float64:
        return _float_block
    if a.dtype.kind == "f":  # longer floats: widened to float64 per block
        return lambda b, acc, sc: _float_block(b.astype(np.float64), acc, sc)
    if a.dtype.kind in "biu":
        return _int_block
    raise TypeError(f"cannot scan dtype {a.dtype}")
