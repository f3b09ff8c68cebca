"""Glue between :func:`.metrics.compare_arrays` and the optional C kernel (``_comparec.c``):
which blocks it may take, and how its per-block partials land in the same accumulators as
the numpy kernels' (:mod:`.blocks`), so the two paths mix block by block.

The kernel takes float32, float16 and bfloat16 blocks that are contiguous, aligned and in native
byte order, one pass per block. Everything else (float64, integers, bool, byte-swapped or
misaligned data) and every block holding NaN/Inf (the kernel answers None) stays on numpy:
those are rare, and the NaN/Inf policy lives in one place. The checks here are the first line;
the kernel checks the buffer again and raises ValueError rather than read out of bounds, which
this module turns into the numpy path.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .blocks import Acc, Kld, Side

F32, F16, BF16 = 0, 1, 2
_KINDS = {"f4": F32, "f2": F16, "bf16": BF16}


def kind_of(side: Side) -> int | None:
    """The kernel's word kind for a side's dtype (None: numpy only)."""
    k = _KINDS.get(side.code)
    return k if k is not None and side.a.dtype.isnative else None


def fits(raw: np.ndarray) -> bool:
    """A block the kernel can read as it is (chunks of a C-contiguous array are; nditer's
    buffered chunks of a strided view are copies, contiguous too)."""
    return raw.flags.c_contiguous and raw.flags.aligned and raw.dtype.isnative and raw.size > 0


def block_range(mod: ModuleType, kind: int | None, raw: np.ndarray) -> tuple[float, float] | None:
    """(min, max) of one block's float32 values with NaN/Inf counted as 0, or None (numpy)."""
    if kind is None or not fits(raw):
        return None
    try:
        return mod.range(raw, kind)
    except ValueError:
        return None


def general(mod: ModuleType, kx: int | None, ky: int | None, xr: np.ndarray, yr: np.ndarray,
            off: int, acc: Acc, kld: Kld | None) -> bool:
    """One differing block through the kernel; False when numpy must take it (unsupported
    data, or NaN/Inf in the block)."""
    if kx is None or ky is None or not (fits(xr) and fits(yr)):
        return False
    try:
        r = mod.block(xr, yr, kx, ky, acc.first_diff is None, acc.mad,
                      None if kld is None else kld.params())
    except ValueError:
        return False
    if r is None:
        return False
    (sx, sy, sxx, syy, sxy, sdd, sad, srel, mad, mad_i, mrel, c1, c5, nd, fd, sa, sb, g) = r
    acc.sx.append(sx), acc.sy.append(sy)
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
        kld.add_g(sa, sb, g)
    return True


def identical(mod: ModuleType, kind: int | None, xr: np.ndarray, yr: np.ndarray) -> tuple[float, float] | bool:
    """(Σx, Σx²) of a block whose bytes are equal on both sides; False when they differ; True
    when the kernel cannot tell (numpy decides, as without the kernel)."""
    if kind is None or not (fits(xr) and fits(yr)):
        return True
    try:
        r = mod.same(xr, yr, kind)
    except ValueError:
        return True
    return False if r is None else r


def same_terms(mod: ModuleType, kind: int | None, raw: np.ndarray, kld: Kld) -> bool:
    """KLD terms of a block equal on both sides (its values ``raw`` on both); False: numpy."""
    if kind is None or not fits(raw):
        return False
    try:
        r = mod.block(raw, raw, kind, kind, False, math.inf, kld.params())
    except ValueError:
        return False
    if r is None:
        return False
    kld.add_g(r[15], r[16], r[17])
    return True
