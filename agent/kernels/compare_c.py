"""Glue between :func:`~precision_agent.compare.metrics.compare_arrays` and the optional C kernel
(``compare.c``): which blocks it may take, and how its per-block partials land in the same
accumulators as the numpy kernels' (:mod:`.compare_numpy`), so the two paths mix block by block.

The kernel takes float32, float16 and bfloat16 blocks that are contiguous and in native byte
order (a misaligned one is copied first), one pass per block. Everything else (float64,
integers, bool, byte-swapped data) and every block holding NaN/Inf (the kernel answers None)
stays on numpy:
those are rare, and the NaN/Inf policy lives in one place. The checks here are the first line;
the kernel checks the buffer again and raises ValueError rather than read out of bounds, which
this module turns into the numpy path. Blocks whose bytes are equal on both sides (a rerun
that reproduced) are dispatched here too, C first: :func:`identical_block`.
"""

from __future__ import annotations

import math
import threading
from types import ModuleType
from typing import Callable

from .lazy import np   # numpy on first use (kernels/lazy.py)

from ..safeio import mapped_pages

from .compare_numpy import (Acc, Kld, Range, Scratch, Side, _widen, _zero_nonfinite, dot, general_block, pairs,
                     same_bytes)

F32, F16, BF16 = 0, 1, 2
_KINDS = {"f4": F32, "f2": F16, "bf16": BF16}


def kind_of(side: Side) -> int | None:
    """The kernel's word kind for a side's dtype (None: numpy only)."""
    k = _KINDS.get(side.code)
    return k if k is not None and side.a.dtype.isnative else None


def fits(raw: np.ndarray) -> bool:
    """A block the kernel can read, perhaps after :func:`aligned` (chunks of a C-contiguous
    array are contiguous; nditer's buffered chunks of a strided view are copies)."""
    return raw.flags.c_contiguous and raw.dtype.isnative and raw.size > 0


_kept = threading.local()


def aligned(raw: np.ndarray, slot: int) -> np.ndarray:
    """``raw``, or its copy in a buffer kept per thread (one per slot) when its address is not a
    multiple of its item size: a zip member's data starts wherever the zip put it, and the
    kernel reads whole words. One copy costs far less than the numpy passes it saves."""
    if raw.flags.aligned:
        return raw
    bufs = getattr(_kept, "bufs", None)
    if bufs is None:
        bufs = _kept.bufs = [np.empty(0), np.empty(0)]
    if bufs[slot].nbytes < raw.nbytes:
        bufs[slot] = np.empty((raw.nbytes + 7) // 8)   # float64 words: 8-byte aligned
    out = bufs[slot].view(np.uint8)[:raw.nbytes].view(raw.dtype)
    np.copyto(out, raw)
    return out


def range_fn(mod: ModuleType) -> Callable[[Side, np.ndarray], Range | None]:
    """The pre-pass's per-block range through the kernel (None for a block it cannot take)."""
    return lambda side, raw: block_range(mod, kind_of(side), raw)


def block_range(mod: ModuleType, kind: int | None, raw: np.ndarray) -> Range | None:
    """(min, max) of one block's float32 values with NaN/Inf counted as 0, or None (numpy)."""
    if kind is None or not fits(raw):
        return None
    try:
        return mod.range(aligned(raw, 0), kind)
    except (ValueError, BufferError):
        return None


def general(mod: ModuleType, kx: int | None, ky: int | None, xr: np.ndarray, yr: np.ndarray,
            off: int, acc: Acc, kld: Kld | None,
            sums: dict[int, tuple[float, float]] | None = None) -> tuple[Range, Range] | None:
    """One differing block through the kernel: its ranges ((min, max) of x, of y); None when
    numpy must take it (unsupported data, or NaN/Inf in the block). ``sums``: gets the block's
    (Σx, Σy)."""
    if kx is None or ky is None or not (fits(xr) and fits(yr)):
        return None
    try:
        r = mod.block(aligned(xr, 0), aligned(yr, 1), kx, ky, acc.first_diff is None, acc.mad,
                      None if kld is None else kld.params(off))
    except (ValueError, BufferError):
        return None
    if r is None:
        return None
    return take(r, off, acc, kld, sums)


def take(r: tuple, off: int, acc: Acc, kld: Kld | None,
         sums: dict[int, tuple[float, float]] | None = None) -> tuple[Range, Range]:
    """The kernel's partials of the differing block at ``off`` (block()'s tuple) into ``acc``
    (and ``kld``, ``sums``); returns its ranges."""
    (sx, sy, sxx, syy, sxy, sdd, sad, srel, mad, mad_i, mrel, c1, c5, nd, fd, *terms,
     lx, hx, ly, hy) = r
    acc.sx.append(sx), acc.sy.append(sy)
    if sums is not None:
        sums[off] = (sx, sy)
    acc.sxx.append(sxx), acc.syy.append(syy), acc.sxy.append(sxy)
    acc.sdd.append(sdd), acc.sad.append(sad), acc.srel.append(srel)
    if mad > acc.mad:  # the first block to reach a new maximum keeps the first index (its
        # first pair at that distance: the kernel looks for it only above acc.mad)
        acc.mad, acc.mad_idx = mad, off + mad_i
    acc.mrel = max(acc.mrel, mrel)
    acc.c1 += c1
    acc.c5 += c5
    if nd:
        acc.differ += nd
        if acc.first_diff is None:
            acc.first_diff = off + fd
    if kld is not None:
        kld.add_g(*terms)
    return (lx, hx), (ly, hy)


def identical(mod: ModuleType, kind: int | None, xr: np.ndarray, yr: np.ndarray) -> tuple[float, float] | bool:
    """(Σx, Σx²) of a block whose bytes are equal on both sides; False when they differ; True
    when the kernel cannot tell (numpy decides, as without the kernel)."""
    if kind is None or not (fits(xr) and fits(yr)):
        return True
    try:
        r = mod.same(aligned(xr, 0), aligned(yr, 1), kind)
    except (ValueError, BufferError):
        return True
    return False if r is None else r


def same_terms(mod: ModuleType, kind: int | None, raw: np.ndarray, kld: Kld, off: int) -> bool:
    """KLD terms of a block equal on both sides (its values ``raw`` on both); False: numpy."""
    if kind is None or not fits(raw):
        return False
    return terms_of_same(mod, kind, aligned(raw, 0), kld, off)


def terms_of_same(mod: ModuleType, kind: int, words: object, kld: Kld, off: int) -> bool:
    """same_terms on a buffer the kernel reads as it is (an aligned array, a memoryview)."""
    try:
        r = mod.terms(words, words, kind, kind, kld.params(off))
    except (ValueError, BufferError):
        return False
    if r is None:
        return False
    kld.add_g(*r)
    return True


# -- identical blocks: C where it can, numpy otherwise -------------------------------------------
def identical_block(sx_: Side, raw: np.ndarray, off: int, acc: Acc, sc: Scratch,
                    kld: Kld | None, mod: ModuleType | None = None,
                    sums: tuple[float, float] | None = None) -> None:
    """A block whose bytes are equal on both sides: only the norms, sums and KLD terms
    (``sums``: its (Σx, Σx²) from the C kernel, which then gives the KLD terms too)."""
    m = raw.size
    x = sc.x[:m]
    widened = False
    if sums is not None and math.isfinite(sums[0]):
        s, q = sums
    else:
        _widen(sx_, raw, x, sc)
        widened = True
        s = float(np.add.reduce(x))
        if not math.isfinite(s):  # NaN/Inf at the same places on both sides: zeroed, all matched
            k = _zero_nonfinite(x)
            acc.nonfin_x += k
            acc.nonfin_y += k
            acc.dirty.add(off)
            s = float(np.add.reduce(x))
        q = dot(x, x)
    acc.sx.append(s), acc.sy.append(s)
    acc.sxx.append(q), acc.syy.append(q), acc.sxy.append(q)
    acc.c1 += m
    acc.c5 += m
    if kld is None:
        acc.kld_todo.append((off, m, s))  # KLD is 0 unless another block differs: then revisited
    elif not kld.same_free(off, m, s):
        if not widened and mod is not None and same_terms(mod, kind_of(sx_), raw, kld, off):
            return
        if not widened:
            _widen(sx_, raw, x, sc)
        kld.same_block(off, x, sc.y[:m], sc.z[:m], s)


def revisit_identical(sx_: Side, x: np.ndarray, y: np.ndarray, n: int, acc: Acc, sc: Scratch,
                      kld: Kld, mod: ModuleType | None = None) -> None:
    """KLD terms of the identical blocks met before the first differing one (read again only
    where their Σx cannot give them)."""
    todo = {off: s for off, m, s in acc.kld_todo if not kld.same_free(off, m, s)}
    if not todo:
        return
    kind = kind_of(sx_) if mod is not None else None
    for off, xr, _ in pairs(x, y, n):
        if off in todo:
            if off not in acc.dirty and mod is not None and same_terms(mod, kind, xr, kld, off):
                continue
            m = xr.size
            a = sc.x[:m]
            _widen(sx_, xr, a, sc)
            if off in acc.dirty:
                _zero_nonfinite(a)
            kld.same_block(off, a, sc.y[:m], sc.z[:m], todo[off])


# -- two passes: every metric and the ranges, then KLD's terms -----------------------------------
def takes_whole(mod: ModuleType | None, kx: int | None, ky: int | None) -> bool:
    """Whether a pair goes to :func:`two_pass`: float32 pairs, and any pair the kernel reads
    where its AVX-512 or AVX2 variant runs. On the baseline variant (128-bit vectors) a
    float16/bfloat16 side keeps the one-pass flow: ranges from its words are cheap there, and a
    second conversion of every element in pass 2 is not."""
    if mod is None or kx is None or ky is None:
        return False
    return kx == ky == F32 or mod.variant() in ("avx512", "avx2")


def two_pass(mod: ModuleType, sx_: Side, sy_: Side, kx: int, ky: int, n: int, acc: Acc,
             sc: Scratch, uview: np.dtype | None) -> Kld | None | bool:
    """A compare the kernel takes whole: pass 1 gives every block's metrics and ranges while
    the block is in cache (the range pre-pass of the one-pass flow would read both sides
    once more from memory); pass 2 reads the differing blocks again for KLD's terms only,
    which need both sides' global ranges. A block holding NaN/Inf, which the kernel leaves
    to numpy's policy, takes numpy's general_block in pass 1 and numpy's KLD terms in pass 2,
    and the others stay in C. Returns the Kld (None: every block identical), or False when the
    kernel refused a buffer: the caller starts again with a fresh ``acc`` on the one-pass flow."""
    x, y = sx_.a, sy_.a
    ranges: dict[int, tuple[Range, Range]] = {}
    block_sums: dict[int, tuple[float, float]] = {}
    on_numpy: set[int] = set()
    whole = _whole(x, y)
    if whole is not None:
        if not _pass1_whole(mod, sx_, sy_, kx, ky, whole, n, acc, sc, uview, ranges, block_sums,
                            on_numpy):
            return False
    for off, xr, yr in pairs(x, y, n) if whole is None else ():
        if uview is not None:
            same = identical(mod, kx, xr, yr)
            if same is not False:
                sums = same if isinstance(same, tuple) else None
                if sums is not None or same_bytes(xr, yr, uview, sc.b1):
                    identical_block(sx_, xr, off, acc, sc, None, mod, sums)
                    continue
        acc.bitwise = False
        got = general(mod, kx, ky, xr, yr, off, acc, None, block_sums)
        if got is None:
            got = _numpy_block(sx_, sy_, xr, yr, off, acc, sc, block_sums, on_numpy)
        ranges[off] = got
    if not ranges:
        return None
    todo = {off for off, _, _ in acc.kld_todo}
    skip = todo | on_numpy
    for off, xr, _ in pairs(x, y, n) if todo else ():   # identical blocks: one side's range
        if off in todo:
            r = block_range(mod, kx, xr)
            if r is None:
                return False
            ranges[off] = (r, r)
    kld = Kld(sx_, sy_, x, y, n, sc, ranges=ranges)
    if whole is not None:
        if not _pass2_whole(mod, kx, ky, whole, n, kld, skip, block_sums):
            return False
    for off, xr, yr in pairs(x, y, n) if whole is None or on_numpy else ():
        if off in on_numpy:   # numpy's terms, on the values general_block compared
            m = xr.size
            a, b = sc.x[:m], sc.y[:m]
            _widen(sx_, xr, a, sc)
            _widen(sy_, yr, b, sc)
            _zero_nonfinite(a)
            _zero_nonfinite(b)
            kld.block(off, a, b, sc.z[:m], *block_sums[off])
        elif whole is None and off not in todo:
            tot = kld.totals(off, xr.size, *block_sums[off])
            try:
                t = mod.terms(aligned(xr, 0), aligned(yr, 1), kx, ky, kld.params(off), tot is None)
            except (ValueError, BufferError):
                t = None
            if t is None:
                return False
            kld.add_g(*_with_totals(t, tot))
    if acc.kld_todo:
        revisit_identical(sx_, x, y, n, acc, sc, kld, mod)
    return kld


def _with_totals(t: tuple, tot: tuple[float, float] | None) -> tuple:
    """terms()'s partials, with the near terms' Σa, Σb taken as the block's (``tot``, from pass
    1's sums, when the kernel was asked not to sum them) less the far terms'."""
    return t if tot is None else (tot[0] - t[4], tot[1] - t[5], *t[2:])


WHOLE_MAPPED_BYTES = 64 << 20   # mapped tensors above this take the per-block path (bounded RSS)


def _whole(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Both tensors flat, when the kernel can loop over their blocks itself (C order, aligned,
    native): the common case; a zip member's misaligned data keeps the per-block path, and so
    do large memory-mapped tensors, whose pages the per-block path drops from the RSS as it goes."""
    if x.flags.c_contiguous and y.flags.c_contiguous and x.flags.aligned and y.flags.aligned \
            and x.dtype.isnative and y.dtype.isnative:
        if max(x.nbytes, y.nbytes) > WHOLE_MAPPED_BYTES and (mapped_pages(x) or mapped_pages(y)):
            return None
        return x.reshape(-1), y.reshape(-1)
    return None


def _numpy_block(sx_: Side, sy_: Side, xr: np.ndarray, yr: np.ndarray, off: int, acc: Acc,
                 sc: Scratch, block_sums: dict[int, tuple[float, float]],
                 on_numpy: set[int]) -> tuple[Range, Range]:
    """Pass 1 of a block the kernel left to numpy (NaN/Inf): general_block's partials, and the
    ranges and sums of the values it compared (NaN/Inf zeroed, as KLD sees them)."""
    general_block(sx_, sy_, xr, yr, off, acc, sc, None)
    m = xr.size
    a, b = sc.x[:m], sc.y[:m]
    on_numpy.add(off)
    block_sums[off] = (acc.sx[-1], acc.sy[-1])
    return (float(a.min()), float(a.max())), (float(b.min()), float(b.max()))


def _pass1_whole(mod: ModuleType, sx_: Side, sy_: Side, kx: int, ky: int,
                 whole: tuple[np.ndarray, np.ndarray], n: int, acc: Acc, sc: Scratch,
                 uview: np.dtype | None, ranges: dict[int, tuple[Range, Range]],
                 block_sums: dict[int, tuple[float, float]], on_numpy: set[int]) -> bool:
    """Pass 1 of two_pass in one kernel call (blocks()), blocks holding NaN/Inf on numpy."""
    fx, fy = whole
    try:
        rows = mod.blocks(fx, fy, kx, ky, n, uview is not None, acc.first_diff is None, acc.mad)
    except (ValueError, BufferError):
        return False
    for k, r in enumerate(rows):
        off = k * n
        if r is None:
            acc.bitwise = False
            ranges[off] = _numpy_block(sx_, sy_, fx[off:off + n], fy[off:off + n], off, acc, sc,
                                       block_sums, on_numpy)
            continue
        if len(r) == 2:   # bytes equal on both sides: (Σx, Σx²)
            identical_block(sx_, fx[off:off + n], off, acc, sc, None, mod, r)
            continue
        acc.bitwise = False
        ranges[off] = take(r, off, acc, None, block_sums)
    return True


def _pass2_whole(mod: ModuleType, kx: int, ky: int, whole: tuple[np.ndarray, np.ndarray], n: int,
                 kld: Kld, skip: set[int], block_sums: dict[int, tuple[float, float]]) -> bool:
    """Pass 2 of two_pass in one kernel call (terms_blocks()) over the blocks not in skip."""
    fx, fy = whole
    size = len(fx)   # an array's or a memoryview's (compare_raw.py)
    flags = bytearray(-(-size // n))
    totals: dict[int, tuple[float, float]] = {}
    for k in range(len(flags)):
        off = k * n
        if off in skip:
            flags[k] = 1
            continue
        tot = kld.totals(off, min(n, size - off), *block_sums[off])
        if tot is not None:
            totals[off] = tot
        flags[k] = (2 if kld.params(off)[4] else 0) | (4 if tot is None else 0)
    try:
        rows = mod.terms_blocks(fx, fy, kx, ky, n, kld.params(0)[:4], bytes(flags))
    except (ValueError, BufferError):
        return False
    if rows is None:
        return False
    for k, t in enumerate(rows):
        if t is None:
            continue
        kld.add_g(*_with_totals(t, totals.get(k * n)))
    return True
