"""One-pass statistics of a dumped tensor, in cache-sized blocks with bounded memory.

``scan_array`` reads an array (a memmap, a view, any shape or memory order) block by block and
returns a :class:`~precision_agent.model.TensorStats`. Temporaries are block-sized only, so a
4 GiB memmapped file is scanned with a few hundred kB of working memory (plus the page cache).

Statistics semantics
--------------------
* ``count``: number of elements (``a.size``).
* ``nan`` / ``pos_inf`` / ``neg_inf``: how many elements are NaN, +Inf, -Inf (always 0 for
  integer and bool tensors).
* ``min`` / ``max`` / ``mean`` / ``l2norm``: over the FINITE elements only; ``None`` when there
  are none (empty tensor, or every element non-finite). ``mean`` = sum / finite count and
  ``l2norm`` = sqrt(sum of squares), both accumulated in float64 (per block with numpy/BLAS,
  blocks combined with ``math.fsum``), so they agree with a float64 reference to ~1e-15 of
  ``sum(|x|)``. For float64 input with |x| above ~1e154 the sum of squares can overflow to Inf,
  exactly as the float64 reference would.
* ``zero_fraction``: zeros (+0 and -0) / count; ``None`` when count == 0.
* ``fp16_saturated``: for float16 tensors, how many finite elements have |x| >= 65504 (the
  largest finite half: older Ascend chips saturate there instead of producing Inf); 0 otherwise.
* integer tensors: exact integer min/max (then converted to float), mean and l2norm in float64
  of the float64-converted values; bool is treated as the integers 0/1.
* ``dtype="bfloat16"``: the array holds raw bfloat16 words as uint16; each block is converted
  exactly by placing the word in the high half of a uint32 and viewing it as float32.
"""

from __future__ import annotations

import math
import mmap
import sys
from typing import Any

import numpy as np

from ..model import TensorStats

FP16_MAX = 65504.0
DEFAULT_BLOCK = 1 << 16

_LITTLE = sys.byteorder == "little"
_F16_MAGIC = np.float32(2.0 ** 112)       # rebias a half exponent (15) to a single one (127)
_F16_MASK = np.int32(-1879048193)         # 0x8FFFFFFF: keep the sign, clear sign-extension bits


class _Acc:
    """Running statistics over blocks (all Python scalars)."""

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


class _Scratch:
    """Block-sized buffers reused across blocks (never more than a few block sizes)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.f64 = np.empty(n, np.float64)
        self.ones = np.ones(n, np.float64)
        self.bools = np.empty(n, np.bool_)
        self._u32: np.ndarray | None = None
        self._i32: np.ndarray | None = None

    @property
    def u32(self) -> np.ndarray:
        if self._u32 is None:
            self._u32 = np.zeros(self.n, np.uint32)
        return self._u32

    @property
    def i32(self) -> np.ndarray:
        if self._i32 is None:
            self._i32 = np.empty(self.n, np.int32)
        return self._i32


def _finite_float_block(b: np.ndarray, acc: _Acc, sc: _Scratch, mn: Any, mx: Any) -> None:
    """Sums and zeros of a block known to hold finite floats only, with its min/max given."""
    m = b.size
    if m == 0:
        return
    acc.minmax(float(mn), float(mx))
    if b.dtype == np.float64:
        x = b
    else:
        x = sc.f64[:m]
        np.copyto(x, b)
    acc.sums.append(float(np.dot(x, sc.ones[:m])))
    acc.sqs.append(float(np.dot(x, x)))
    np.equal(b, 0, out=sc.bools[:m])
    acc.zeros += int(np.count_nonzero(sc.bools[:m]))
    acc.finite += m


def _float_block(b: np.ndarray, acc: _Acc, sc: _Scratch, fp16: bool) -> None:
    """A block of floats (float32/float64, or float16 values already widened to float32)."""
    if b.size == 0:
        return
    mn = np.minimum.reduce(b)
    mx = np.maximum.reduce(b)
    if mn > -np.inf and mx < np.inf:  # NaN fails both comparisons: the block is all finite
        _finite_float_block(b, acc, sc, mn, mx)
        if fp16 and max(-mn, mx) >= FP16_MAX:
            acc.sat += int(np.count_nonzero(np.abs(b) >= FP16_MAX))
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
        _finite_float_block(f, acc, sc, np.minimum.reduce(f), np.maximum.reduce(f))
        if fp16:
            acc.sat += int(np.count_nonzero(np.abs(f) >= FP16_MAX))


def _half_block(b: np.ndarray, acc: _Acc, sc: _Scratch) -> None:
    """float16 block: widened to float32 with integer ops (faster than numpy's half cast)."""
    m = b.size
    i = sc.i32[:m]
    np.copyto(i, b.view(np.int16))                 # sign-extends
    np.left_shift(i, 13, out=i)                    # exponent+mantissa into single position
    np.bitwise_and(i, _F16_MASK, out=i)           # drop the extension bits, keep the sign
    f = i.view(np.float32)
    np.multiply(f, _F16_MAGIC, out=f)              # exact: rebias, normalises half subnormals
    mn = np.minimum.reduce(f)
    mx = np.maximum.reduce(f)
    if mn > -65536.0 and mx < 65536.0:  # half Inf/NaN land at |x| >= 65536 here: none in block
        _finite_float_block(f, acc, sc, mn, mx)
        if max(-mn, mx) >= FP16_MAX:
            acc.sat += int(np.count_nonzero(np.abs(f) >= FP16_MAX))
        return
    _float_block(b.astype(np.float32), acc, sc, fp16=True)


def _bf16_block(b: np.ndarray, acc: _Acc, sc: _Scratch) -> None:
    m = b.size
    u = sc.u32[:m]
    np.copyto(u, b)
    np.left_shift(u, 16, out=u)
    _float_block(u.view(np.float32), acc, sc, fp16=False)


def _int_block(b: np.ndarray, acc: _Acc, sc: _Scratch) -> None:
    m = b.size
    if m == 0:
        return
    if b.dtype == np.bool_:
        b = b.view(np.uint8)
    acc.minmax(int(np.minimum.reduce(b)), int(np.maximum.reduce(b)))
    x = sc.f64[:m]
    np.copyto(x, b, casting="unsafe")
    acc.sums.append(float(np.dot(x, sc.ones[:m])))
    acc.sqs.append(float(np.dot(x, x)))
    acc.zeros += m - int(np.count_nonzero(b))
    acc.finite += m


_RELEASE_BYTES = 32 << 20


def _blocks(a: np.ndarray, n: int, release=None):
    """1-D chunks of at most ``n`` elements covering ``a`` once, in memory order when possible.

    ``release(done_bytes)`` (contiguous arrays only) is called about every 32 MiB with the bytes
    already scanned, so a memmap's caller can drop those pages from the process's RSS."""
    if a.size == 0:
        return
    if a.flags.c_contiguous or a.flags.f_contiguous:
        flat = a.reshape(-1, order="F" if not a.flags.c_contiguous else "C")  # a view
        every = max(1, _RELEASE_BYTES // max(1, n * a.itemsize))
        for j, i in enumerate(range(0, flat.size, n)):
            yield flat[i:i + n]
            if release is not None and j % every == every - 1:
                release(min(i + n, flat.size) * a.itemsize)
        return
    it = np.nditer(a, flags=["external_loop", "buffered", "zerosize_ok", "refs_ok"],
                   op_flags=[["readonly"]], order="K", buffersize=n)
    for chunk in it:
        yield chunk


def _fsum(values: list[float]) -> float:
    try:
        return math.fsum(values)
    except (OverflowError, ValueError):  # Inf/NaN or intermediate overflow (float64 input)
        return float(sum(values))


def scan_array(a: np.ndarray, *, dtype: str | None = None, name: str = "", io: str = "",
               index: int = 0, block_elems: int = DEFAULT_BLOCK, step: int | None = None,
               rank: int | None = None, path: str = "", _release=None) -> TensorStats:
    """Statistics of ``a`` in one blocked pass (see the module docstring for the semantics).

    ``dtype="bfloat16"`` means ``a`` holds raw bfloat16 words (uint16/int16). Other dtypes are
    taken from ``a``: float16/32/64 (and longer floats, widened to float64 per block), signed and
    unsigned integers, bool. Raises TypeError for anything else (complex, object, strings).
    """
    a = np.asarray(a)  # a memmap becomes a plain ndarray view: no copy, cheaper slicing
    if block_elems < 1:
        raise ValueError("block_elems must be >= 1")
    n = int(block_elems)
    bf16 = dtype == "bfloat16" or a.dtype.name == "bfloat16"
    if bf16:
        if a.dtype.itemsize != 2:
            raise TypeError(f"bfloat16 data must come as 16-bit words, got {a.dtype}")
        if a.dtype.kind not in "ui":
            a = a.view(np.uint16)
        kind_name = "bfloat16"
    else:
        kind_name = dtype or a.dtype.name
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))  # pragma: no cover - dumps are native-endian
    sc = _Scratch(max(1, min(n, a.size)))
    acc = _Acc()
    k = a.dtype.kind
    if bf16:
        for b in _blocks(a, n, _release):
            _bf16_block(b, acc, sc)
    elif a.dtype == np.float16:
        for b in _blocks(a, n, _release):
            _half_block(b, acc, sc)
    elif a.dtype in (np.float32, np.float64):
        for b in _blocks(a, n, _release):
            _float_block(b, acc, sc, fp16=False)
    elif k == "f":
        for b in _blocks(a, n, _release):
            _float_block(b.astype(np.float64), acc, sc, fp16=False)
    elif k in "biu":
        for b in _blocks(a, n, _release):
            _int_block(b, acc, sc)
    else:
        raise TypeError(f"cannot scan dtype {a.dtype}")

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
                  index: int = 0, block_elems: int = DEFAULT_BLOCK) -> TensorStats:
    """Scan a .npy file through ``np.load(mmap_mode="r")``: the file is never loaded whole."""
    a = np.load(path, mmap_mode="r", allow_pickle=False)
    mm = getattr(a, "_mmap", None)
    release = None
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED") and a.ndim:
        # file-backed pages a process has touched count in its RSS until unmapped: drop the
        # ones already scanned (they stay in the page cache; RSS stays block-bounded)
        delta = int(getattr(a, "offset", 0)) % mmap.ALLOCATIONGRANULARITY

        def release(done: int) -> None:
            end = (delta + done) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > 0:
                try:
                    mm.madvise(mmap.MADV_DONTNEED, 0, end)
                except (OSError, ValueError):  # pragma: no cover - advisory only
                    pass
    try:
        return scan_array(a, dtype=dtype, name=name, io=io, index=index, block_elems=block_elems,
                          path=str(path), _release=release)
    finally:
        del a
        if mm is not None:
            try:
                mm.close()
            except Exception:  # pragma: no cover - a view still references it; GC will close
                pass
