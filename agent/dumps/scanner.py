"""One-pass statistics of a dumped tensor, in cache-sized blocks with bounded memory.

The array kernels and their dispatch; a tensor lying in a file is read through
:mod:`.windows` (``scan_region``, ``scan_file_npy``), which imports this module, never the reverse.

``scan_array`` reads an array (a memmap, a view, any shape or memory order) block by block and
returns a :class:`~precision_agent.model.TensorStats`. Temporaries are block-sized only, so a
4 GiB memmapped file is scanned with a few MB of working memory (plus the page cache).

Statistics semantics
--------------------
* ``count``: number of elements; ``nan`` / ``pos_inf`` / ``neg_inf``: how many are NaN, +Inf,
  -Inf (always 0 for integer and bool tensors).
* ``min`` / ``max`` / ``mean`` / ``l2norm`` / ``abs_mean``: over the FINITE elements only;
  ``None`` when there are none. ``mean`` = sum / finite count, ``l2norm`` = sqrt(sum of
  squares), ``abs_mean`` = sum of |x| / finite count (MindInsight's watchpoints are stated on
  it; a block of one sign reuses its sum). All three sums are kept alike, partial sums
  combined with ``math.fsum``. float64, integer and bool tensors are summed in float64 (error
  ~1e-15 of ``sum(|x|)``). float32, float16 and bfloat16 tensors are summed in float32 over
  short runs and in float64 across them: numpy kernels, rows of ``ROW`` elements (BLAS dots
  with FMA and >= 32 partial sums); C kernel, 16 lanes of pair sums over 1024-element chunks
  (32 additions per lane). Error below ~1e-5 of ``mean(|x|)`` resp. of the norm (typically
  1e-7), under the input's own rounding for half types. A float32-range block with
  magnitudes outside 2^-50..2^50 (where float32 squares could overflow or lose precision) is
  summed in float64 instead, as is a block holding NaN/Inf in the C kernel. float64 input
  above ~1e154 can overflow the sum of squares to Inf, exactly as a float64 reference would.
* ``zero_fraction``: zeros (+0 and -0) / count; ``None`` when count == 0.
* ``fp16_saturated``: for float16 tensors, how many finite elements have |x| >= 65504 (the
  largest finite half: older Ascend chips saturate there instead of producing Inf); 0 otherwise.
* integer tensors: exact integer min/max (then converted to float); bool counts as 0/1.
* ``dtype="bfloat16"``: the array holds raw bfloat16 words (uint16), converted exactly by
  placing the word in the high half of a uint32 viewed as float32.

Speed (bench/scan.py): two interchangeable block kernels give the same statistics (within the
tolerances above); ``kernels.get("scan")`` picks per ``scan_array`` call (agent/kernels/,
``PRECISION_AGENT_KERNELS``).

* C (``kernels/scan.c``, built where a compiler was at install): one pass per block over float32,
  float64, float16 and bfloat16 (raw words) in vector lanes: min, max, zeros, sums. A NaN/Inf
  shows in the block's sum (float16 NaN/Inf words in its min/max), and only then, or when a
  float32-range block leaves the safe range, a careful float64 loop rescans the block and
  counts them. It runs at about memory speed for float32/float64 and releases the GIL
  (``threads`` workers run at once). Blocks it declines (misaligned, strided, non-native
  order) and integer/bool tensors take the numpy kernels.
* numpy (``kernels/scan_numpy.py``): an all-finite block is recognised from its min and max (NaN
  propagates through both, ±Inf shows in them), so NaN/Inf counting runs only on blocks that
  hold some. float16/bfloat16 blocks get min, max, the NaN/Inf check and whether ±0 occur from
  integer reductions on the raw words (their bit patterns order like sign-magnitude integers);
  only the sums need float32 values. BLAS dots are cut into rows of ``ROW`` elements because
  OpenBLAS runs longer ones on its own threads: the scanner uses exactly ``threads`` cores.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from .. import kernels
from ..model import TensorStats
from ..kernels import scan_c
from ..kernels.scan_numpy import FP16_MAX, ROW, Acc, Scratch, block_fn

__all__ = ["DEFAULT_BLOCK", "FP16_MAX", "ROW", "kernel_for", "scan_array", "scan_words", "stats_of"]

DEFAULT_BLOCK = 1 << 18          # elements: 1 MiB of float32, fits a core's L2 with its scratch
_RELEASE_BYTES = 32 << 20

Release = Callable[[int, int], None]


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


def _run(blocks: Iterator[np.ndarray], fn: Callable, n: int, row: int) -> Acc:
    """One worker: its own accumulator and scratch over its blocks."""
    acc, sc = Acc(), Scratch(n, row)
    with np.errstate(all="ignore"):  # per thread; tentative float32 dots may overflow
        for b in blocks:
            fn(b, acc, sc)
    sc.flush(acc)
    return acc


def _scan(a: np.ndarray, fn: Callable, n: int, threads: int, release: Release | None) -> Acc:
    row = max(1, min(ROW, n))
    if a.size == 0:
        return Acc()
    if not (a.flags.c_contiguous or a.flags.f_contiguous):
        return _run(_strided_blocks(a, n), fn, min(n, a.size), row)
    flat = a.reshape(-1, order="F" if not a.flags.c_contiguous else "C")  # a view
    spans = _ranges(flat.size, n, threads)

    def work(span: tuple[int, int]) -> Acc:
        return _run(_flat_blocks(flat, span[0], span[1], n, release), fn, min(n, span[1] - span[0]), row)

    if len(spans) == 1:
        return work(spans[0])
    with ThreadPoolExecutor(max_workers=len(spans), thread_name_prefix="scan") as pool:
        parts = list(pool.map(work, spans))
    for p in parts[1:]:
        parts[0].merge(p)
    return parts[0]


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
    acc = _scan(a, kernel_for(a.dtype, bf16), int(block_elems), int(threads), _release)
    return stats_of(acc, int(a.size), kind_name, tuple(int(s) for s in a.shape), name=name, io=io,
                    index=index, step=step, rank=rank, path=path)


_WORD_KERNELS = {"f4": "f32", "f2": "f16", "bf16": "bf16"}


def scan_words(words: memoryview, code: str, dtype: str, shape: tuple[int, ...], *, name: str = "",
               io: str = "", index: int = 0, block_elems: int = DEFAULT_BLOCK) -> TensorStats | None:
    """Statistics of flat native words (a RawTensor's: ``code`` "f4", "f2" or "bf16") through the
    C kernel alone, without numpy: one worker over blocks of ``block_elems`` from the first
    element, as ``scan_region`` with one thread reads a file's, so the numbers are the same.
    None when the C kernel is not there or declines a block: scan the array then."""
    mod = kernels.get("scan")
    kernel = getattr(mod, _WORD_KERNELS.get(code, ""), None) if mod is not None else None
    if kernel is None or not len(words):
        return None
    n = int(block_elems)
    st = mod.state()
    for off in range(0, len(words), n):
        if not kernel(words[off:off + n], st):
            return None
    acc = Acc()
    scan_c.fold(mod.take(st), acc)
    return stats_of(acc, len(words), "bfloat16" if code == "bf16" else dtype, shape, name=name, io=io,
                    index=index)


def kernel_for(dt: np.dtype, bf16: bool) -> Callable:
    """The block function for data of dtype ``dt`` (native order; ``bf16``: raw bfloat16 words):
    the C kernel where built and it has one for ``dt``, else numpy's. TypeError when none fits."""
    sample = np.empty(0, dtype=dt)
    fn = block_fn(sample, bf16)
    mod = kernels.get("scan")  # per call: PRECISION_AGENT_KERNELS / kernels.forced() decide
    if mod is not None:
        fn = scan_c.block_fn(mod, sample, bf16, fn) or fn
    return fn


def stats_of(acc: Acc, count: int, kind_name: str, shape: tuple[int, ...], *, name: str = "", io: str = "",
             index: int = 0, step: int | None = None, rank: int | None = None, path: str = "") -> TensorStats:
    """The TensorStats of a finished accumulator (see the module docstring for the semantics)."""
    has = acc.finite > 0
    mean = _fsum(acc.sums) / acc.finite if has else None
    l2 = math.sqrt(_fsum(acc.sqs)) if has else None
    abs_mean = _fsum(acc.abss) / acc.finite if has else None
    return TensorStats(
        name=name, io=io, index=index, dtype=kind_name, shape=shape,
        count=count, nan=acc.nan, pos_inf=acc.pinf, neg_inf=acc.ninf,
        min=float(acc.mn) if has else None, max=float(acc.mx) if has else None,
        mean=mean, l2norm=l2, abs_mean=abs_mean, zero_fraction=(acc.zeros / count) if count else None,
        fp16_saturated=acc.sat, step=step, rank=rank, path=path)
