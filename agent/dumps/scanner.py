"""One-pass statistics of a dumped tensor, in cache-sized blocks with bounded memory.

``scan_array`` reads an array (a memmap, a view, any shape or memory order) block by block and
returns a :class:`~precision_agent.model.TensorStats`. Temporaries are block-sized only, so a
4 GiB memmapped file is scanned with a few MB of working memory (plus the page cache).

Statistics semantics
--------------------
* ``count``: number of elements (``a.size``).
* ``nan`` / ``pos_inf`` / ``neg_inf``: how many elements are NaN, +Inf, -Inf (always 0 for
  integer and bool tensors).
* ``min`` / ``max`` / ``mean`` / ``l2norm``: over the FINITE elements only; ``None`` when there
  are none (empty tensor, or every element non-finite). ``mean`` = sum / finite count and
  ``l2norm`` = sqrt(sum of squares); per-block partial sums are combined with ``math.fsum``.
  Precision: float64, integer and bool tensors are summed in float64 (error ~1e-15 of
  ``sum(|x|)``). float32, float16 and bfloat16 tensors are summed in float32 within rows of at
  most 8192 elements (BLAS dots, which use FMA) and in float64 across rows; the error stays
  below ~1e-5 of ``mean(|x|)`` resp. of the norm: far below the input's own rounding for half
  types, and what a float32 tensor's statistics can mean anyway. A float32 block whose
  magnitudes could overflow or underflow in float32 squares (outside 2^-50..2^50) is summed in
  float64 instead. float64 input above ~1e154 can overflow the sum of squares to Inf, exactly
  as the float64 reference would.
* ``zero_fraction``: zeros (+0 and -0) / count; ``None`` when count == 0.
* ``fp16_saturated``: for float16 tensors, how many finite elements have |x| >= 65504 (the
  largest finite half: older Ascend chips saturate there instead of producing Inf); 0 otherwise.
* integer tensors: exact integer min/max (then converted to float), mean and l2norm in float64
  of the float64-converted values; bool is treated as the integers 0/1.
* ``dtype="bfloat16"``: the array holds raw bfloat16 words as uint16; values are converted
  exactly by placing the word in the high half of a uint32 and viewing it as float32.

Speed (see bench/scan.py): an all-finite block is recognised from its min and max (NaN
propagates through both, ±Inf shows in them), so NaN/Inf counting runs only on blocks that
hold some. float16/bfloat16 blocks get min, max, zeros, saturation and the NaN/Inf check from
integer reductions on the raw 16-bit words (a half's bit pattern orders like sign-magnitude);
only the sums need float32 values. BLAS dots are kept under 8192 elements, because OpenBLAS
runs longer ones on its own threads: the scanner uses exactly ``threads`` cores.
"""

from __future__ import annotations

import math
import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np

from ..model import TensorStats

FP16_MAX = 65504.0
DEFAULT_BLOCK = 1 << 18          # elements: 1 MiB of float32, fits a core's L2 with its scratch
ROW = 4096                       # BLAS dot length (OpenBLAS threads dots above 10000 elements)
_FAST_LO = 2.0 ** -50            # float32 squares and row sums stay exact-enough in this range
_FAST_HI = 2.0 ** 50
_RELEASE_BYTES = 32 << 20

_F16_MAGIC = np.float32(2.0 ** 112)       # rebias a half exponent (15) to a single one (127)
_F16_MASK = np.int32(-1879048193)         # 0x8FFFFFFF: keep the sign, clear sign-extension bits

Release = Callable[[int, int], None]


class _Acc:
    """Running statistics over blocks (all Python scalars); one per worker thread."""

    __slots__ = ("nan", "pinf", "ninf", "mn", "mx", "sums", "sqs", "zeros", "finite", "sat")

    def __init__(self) -> None:
        self.nan = self.pinf = self.ninf = self.zeros = self.finite = self.sat = 0
        self.mn: Any = None
        self.mx: Any = None
        self.sums: list[float] = []
        self.sqs: list[float] = []

    def minmax(self, mn: Any, mx: Any) -> None:
        if self.mn is None or mn < self.mn:
            self.mn = mn
        if self.mx is None or mx > self.mx:
            self.mx = mx

    def merge(self, o: "_Acc") -> None:
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


class _Scratch:
    """Block-sized buffers, allocated once per worker and reused for every block."""

    def __init__(self, n: int, row: int) -> None:
        self.n = n
        self.row = row
        self.ones32 = np.ones(row, np.float32)
        self.bools = np.empty(n, np.bool_)
        self._w32: np.ndarray | None = None
        self._f64: np.ndarray | None = None
        # float32 row sums / sums of squares, reduced in float64 when full (not once per block)
        cap = max(1024, n // row)
        self.rs = np.empty(cap, np.float32)
        self.rq = np.empty(cap, np.float32)
        self.used = 0

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

    def rows(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Room for ``k`` more row results (flushing into nothing: call ``flush`` first)."""
        return self.rs[self.used:self.used + k], self.rq[self.used:self.used + k]

    def flush(self, acc: "_Acc") -> None:
        if self.used:
            acc.sums.append(float(np.add.reduce(self.rs[:self.used], dtype=np.float64)))
            acc.sqs.append(float(np.add.reduce(self.rq[:self.used], dtype=np.float64)))
            self.used = 0


# -- sums ---------------------------------------------------------------------------------------
def _exact_sums(x: np.ndarray, acc: _Acc, sc: _Scratch) -> None:
    """Sum and sum of squares in float64 (x is converted into scratch unless already float64)."""
    m = x.size
    if x.dtype != np.float64:
        y = sc.f64[:m]
        np.copyto(y, x, casting="unsafe")
        x = y
    acc.sums.append(float(np.add.reduce(x)))
    k = m // sc.row * sc.row
    q = 0.0
    if k:
        q = float(np.add.reduce(np.vecdot(x[:k].reshape(-1, sc.row), x[:k].reshape(-1, sc.row))))
    if k < m:
        q += float(np.dot(x[k:], x[k:]))
    acc.sqs.append(q)


def _f32_sums(b: np.ndarray, amax: float, acc: _Acc, sc: _Scratch) -> None:
    """Sums of a finite float32 block: float32 row dots (single-threaded BLAS), rows in float64."""
    if not (amax == 0.0 or _FAST_LO <= amax <= _FAST_HI):
        _exact_sums(b, acc, sc)
        return
    m, r = b.size, sc.row
    k = m // r
    if k:
        if sc.used + k > sc.rs.size:
            sc.flush(acc)
        rs, rq = sc.rows(k)
        rows = b[:k * r].reshape(k, r)
        np.vecdot(rows, sc.ones32, out=rs)
        np.vecdot(rows, rows, out=rq)
        sc.used += k
    if k * r < m:
        _exact_sums(b[k * r:], acc, sc)


def _count_zeros(b: np.ndarray, sc: _Scratch) -> int:
    bo = sc.bools[:b.size]
    np.equal(b, 0, out=bo)
    return int(np.count_nonzero(bo))


# -- float blocks -------------------------------------------------------------------------------
def _finite_float(b: np.ndarray, acc: _Acc, sc: _Scratch, mn: Any, mx: Any, fp16: bool) -> None:
    """A block known to hold finite floats only, with its min and max given."""
    mn, mx = float(mn), float(mx)
    acc.minmax(mn, mx)
    acc.finite += b.size
    acc.zeros += _count_zeros(b, sc)
    amax = max(-mn, mx)
    if b.dtype == np.float32:
        _f32_sums(b, amax, acc, sc)
    else:
        _exact_sums(b, acc, sc)
    if fp16 and amax >= FP16_MAX:
        acc.sat += int(np.count_nonzero(np.abs(b) >= FP16_MAX))


def _float_block(b: np.ndarray, acc: _Acc, sc: _Scratch, fp16: bool = False) -> None:
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


# -- float32 / float16 / bfloat16 through their bit patterns ------------------------------------
class _Bits:
    """How to read one float format's raw words (sign-magnitude: as signed ints the largest word
    is the largest non-negative value, as unsigned ints the largest is the most negative one)."""

    def __init__(self, name: str, udt: Any, sdt: Any, exp: int) -> None:
        self.name, self.udt, self.sdt, self.exp = name, np.dtype(udt), np.dtype(sdt), exp
        self.sign = 1 << (8 * self.udt.itemsize - 1)    # also the -0 word

    def value(self, word: int) -> float:
        if self.name == "bfloat16":
            return float(np.array([word << 16], np.uint32).view(np.float32)[0])
        return float(np.array([word], self.udt).view(self.name)[0])


_F32 = _Bits("float32", np.uint32, np.int32, 0x7F800000)   # exponent all ones = Inf/NaN
_F16 = _Bits("float16", np.uint16, np.int16, 0x7C00)
_BF16 = _Bits("bfloat16", np.uint16, np.int16, 0x7F80)
_F16_SAT_WORD = 0x7BFF                                     # 65504, the largest finite half


def _widen(w: np.ndarray, sc: _Scratch, kind: _Bits) -> np.ndarray:
    """float32 values of finite words, exact, with integer ops into scratch (numpy's own half
    cast is ~6x slower than these four passes)."""
    m = w.size
    if kind is _F32:
        return w.view(np.float32)
    if kind is _BF16:
        u = sc.w32[:m]
        np.copyto(u, w)
        np.left_shift(u, 16, out=u)
        return u.view(np.float32)
    i = sc.w32[:m].view(np.int32)
    np.copyto(i, w.view(np.int16))                 # sign-extends
    np.left_shift(i, 13, out=i)                    # exponent+mantissa into single position
    np.bitwise_and(i, _F16_MASK, out=i)           # drop the extension bits, keep the sign
    f = i.view(np.float32)
    np.multiply(f, _F16_MAGIC, out=f)              # exact: rebias, normalises half subnormals
    return f


def _bits_block(w: np.ndarray, acc: _Acc, sc: _Scratch, kind: _Bits) -> None:
    """A block of raw words (unsigned view). Four integer reductions give the min, the max, the
    NaN/Inf check and whether a +0/-0 is present; counting happens only where needed."""
    m = w.size
    if m == 0:
        return
    s = w.view(kind.sdt)
    hs = int(np.maximum.reduce(s))
    hu = int(np.maximum.reduce(w))
    mag = kind.sign - 1
    if hs >= kind.exp or (hu & mag) >= kind.exp:  # an exponent all ones: NaN/Inf in the block
        if kind is _F16:
            f = w.view(np.float16).astype(np.float32)
        else:
            f = _widen(w, sc, kind)
        _float_block(f, acc, sc, fp16=kind is _F16)
        return
    neg, nonneg = hu >= kind.sign, hs >= 0
    lu = int(np.minimum.reduce(w))    # smallest non-negative word, or (all negative) nearest 0
    mx = kind.value(hs if nonneg else lu)
    mn = kind.value(hu if neg else lu)
    acc.minmax(mn, mx)
    acc.finite += m
    if lu == 0:                                                          # some +0
        acc.zeros += m - int(np.count_nonzero(w))
    if neg and int(np.minimum.reduce(s)) == -kind.sign:                 # some -0
        acc.zeros += int(np.count_nonzero(w == kind.sign))
    if kind is _F16 and ((nonneg and hs >= _F16_SAT_WORD) or (neg and (hu & mag) >= _F16_SAT_WORD)):
        acc.sat += int(np.count_nonzero((w & mag) == _F16_SAT_WORD))
    _f32_sums(_widen(w, sc, kind), max(-mn, mx), acc, sc)


# -- integers -----------------------------------------------------------------------------------
def _int_block(b: np.ndarray, acc: _Acc, sc: _Scratch) -> None:
    m = b.size
    if m == 0:
        return
    if b.dtype == np.bool_:
        b = b.view(np.uint8)
    acc.minmax(int(np.minimum.reduce(b)), int(np.maximum.reduce(b)))
    _exact_sums(b, acc, sc)
    acc.zeros += m - int(np.count_nonzero(b))
    acc.finite += m


# -- blocks and workers -------------------------------------------------------------------------
def _ranges(size: int, n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous element ranges, block-aligned, covering ``range(size)``."""
    nblocks = -(-size // n)
    per = -(-nblocks // parts)
    return [(i * per * n, min(size, (i + 1) * per * n)) for i in range(parts) if i * per * n < size]


def _flat_blocks(flat: np.ndarray, lo: int, hi: int, n: int, release: Release | None) -> Iterator[np.ndarray]:
    """1-D slices of ``flat[lo:hi]`` of at most ``n`` elements; ``release(start, end)`` (byte
    offsets) about every 32 MiB so a memmap's caller can drop scanned pages from the RSS."""
    every = max(1, _RELEASE_BYTES // max(1, n * flat.itemsize))
    start = lo
    for j, i in enumerate(range(lo, hi, n)):
        yield flat[i:i + n]
        if release is not None and j % every == every - 1:
            end = min(i + n, hi)
            release(start * flat.itemsize, end * flat.itemsize)
            start = end


def _strided_blocks(a: np.ndarray, n: int) -> Iterator[np.ndarray]:
    it = np.nditer(a, flags=["external_loop", "buffered", "zerosize_ok", "refs_ok"],
                   op_flags=[["readonly"]], order="K", buffersize=n)
    for chunk in it:
        yield chunk


def _block_fn(a: np.ndarray, bf16: bool) -> Callable[[np.ndarray, _Acc, _Scratch], None]:
    if bf16:
        return lambda b, acc, sc: _bits_block(b, acc, sc, _BF16)
    if a.dtype == np.float16:
        return lambda b, acc, sc: _bits_block(b.view(np.uint16), acc, sc, _F16)
    if a.dtype == np.float32:
        return lambda b, acc, sc: _bits_block(b.view(np.uint32), acc, sc, _F32)
    if a.dtype == np.float64:
        return _float_block
    if a.dtype.kind == "f":  # longer floats: widened to float64 per block
        return lambda b, acc, sc: _float_block(b.astype(np.float64), acc, sc)
    if a.dtype.kind in "biu":
        return _int_block
    raise TypeError(f"cannot scan dtype {a.dtype}")


def _scan(a: np.ndarray, fn: Callable, n: int, threads: int, release: Release | None) -> _Acc:
    row = max(1, min(ROW, n))
    if a.size == 0:
        return _Acc()
    if not (a.flags.c_contiguous or a.flags.f_contiguous):
        acc, sc = _Acc(), _Scratch(max(1, min(n, a.size)), row)
        for b in _strided_blocks(a, n):
            fn(b, acc, sc)
        sc.flush(acc)
        return acc
    flat = a.reshape(-1, order="F" if not a.flags.c_contiguous else "C")  # a view

    def work(span: tuple[int, int]) -> _Acc:
        acc, sc = _Acc(), _Scratch(max(1, min(n, span[1] - span[0])), row)
        for b in _flat_blocks(flat, span[0], span[1], n, release):
            fn(b, acc, sc)
        sc.flush(acc)
        return acc

    spans = _ranges(flat.size, n, max(1, threads))
    if len(spans) == 1:
        return work(spans[0])
    with ThreadPoolExecutor(max_workers=len(spans), thread_name_prefix="scan") as pool:
        parts = list(pool.map(work, spans))
    total = _Acc()
    for p in parts:
        total.merge(p)
    return total


def _fsum(values: list[float]) -> float:
    try:
        return math.fsum(values)
    except (OverflowError, ValueError):  # Inf/NaN or intermediate overflow (float64 input)
        return float(sum(values))


def scan_array(a: np.ndarray, *, dtype: str | None = None, name: str = "", io: str = "",
               index: int = 0, block_elems: int = DEFAULT_BLOCK, threads: int = 1,
               step: int | None = None, rank: int | None = None, path: str = "",
               _release: Release | None = None) -> TensorStats:
    """Statistics of ``a`` in one blocked pass (see the module docstring for the semantics).

    ``dtype="bfloat16"`` means ``a`` holds raw bfloat16 words (uint16/int16). Other dtypes are
    taken from ``a``: float16/32/64 (and longer floats, widened to float64 per block), signed and
    unsigned integers, bool. Raises TypeError for anything else (complex, object, strings).
    ``threads`` (default 1: the agent must not compete with training) splits a contiguous array
    into that many block-aligned spans scanned in parallel (numpy releases the GIL).
    """
    a = np.asarray(a)  # a memmap becomes a plain ndarray view: no copy, cheaper slicing
    if block_elems < 1:
        raise ValueError("block_elems must be >= 1")
    if threads < 1:
        raise ValueError("threads must be >= 1")
    bf16 = dtype == "bfloat16" or a.dtype.name == "bfloat16"
    if bf16:
        if a.dtype.itemsize != 2:
            raise TypeError(f"bfloat16 data must come as 16-bit words, got {a.dtype}")
        if a.dtype != np.uint16:
            a = a.view(np.uint16)
        kind_name = "bfloat16"
    else:
        kind_name = dtype or a.dtype.name
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))  # pragma: no cover - dumps are native-endian
    acc = _scan(a, _block_fn(a, bf16), int(block_elems), int(threads), _release)

    count = int(a.size)
    has = acc.finite > 0
    mean = _fsum(acc.sums) / acc.finite if has else None
    l2 = math.sqrt(_fsum(acc.sqs)) if has else None
    return TensorStats(
        name=name, io=io, index=index, dtype=kind_name, shape=tuple(int(s) for s in a.shape),
        count=count, nan=acc.nan, pos_inf=acc.pinf, neg_inf=acc.ninf,
        min=float(acc.mn) if has else None, max=float(acc.mx) if has else None,
        mean=mean, l2norm=l2, zero_fraction=(acc.zeros / count) if count else None,
        fp16_saturated=acc.sat, step=step, rank=rank, path=path)


def scan_file_npy(path: str, *, dtype: str | None = None, name: str = "", io: str = "",
                  index: int = 0, block_elems: int = DEFAULT_BLOCK, threads: int = 1) -> TensorStats:
    """Scan a .npy file through ``np.load(mmap_mode="r")``: the file is never loaded whole."""
    a = np.load(path, mmap_mode="r", allow_pickle=False)
    mm = getattr(a, "_mmap", None)
    release = None
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED") and a.ndim:
        # file-backed pages a process has touched count in its RSS until unmapped: drop the
        # ones already scanned (they stay in the page cache; RSS stays block-bounded)
        delta = int(getattr(a, "offset", 0)) % mmap.ALLOCATIONGRANULARITY

        def release(start: int, end: int) -> None:
            lo = -(-(delta + start) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside only
            hi = (delta + end) // mmap.PAGESIZE * mmap.PAGESIZE
            if hi > lo:
                try:
                    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                except (OSError, ValueError):  # pragma: no cover - advisory only
                    pass
    try:
        return scan_array(a, dtype=dtype, name=name, io=io, index=index, block_elems=block_elems,
                          threads=threads, path=str(path), _release=release)
    finally:
        del a
        if mm is not None:
            try:
                mm.close()
            except Exception:  # pragma: no cover - a view still references it; GC will close
                pass
