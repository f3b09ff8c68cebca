"""Glue between the scanner and its optional C kernel (``scan.c``, chosen by :mod:`.`).

The C kernel folds each block into a small per-worker state (a bytearray kept in the worker's
:class:`~.scan_numpy.Scratch`) instead of returning statistics per block: a 1 MiB block
then costs one call, and the state becomes the worker's :class:`~.scan_numpy.Acc` entries
once, when the worker flushes. A block the kernel cannot read directly (misaligned, strided,
non-native order) is handed to the numpy kernel for the same dtype, block by block.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

from .lazy import np   # numpy on first use (kernels/lazy.py)

from .scan_numpy import Acc, Scratch

BlockFn = "Callable[[np.ndarray, Acc, Scratch], None]"   # annotations only: a string, no numpy


def fold(values: tuple, acc: Acc) -> None:
    """Add one ``take()`` of a C state to ``acc``."""
    nan, pinf, ninf, zeros, finite, sat, mn, mx, s, q, a = values
    acc.nan += nan
    acc.pinf += pinf
    acc.ninf += ninf
    acc.zeros += zeros
    acc.finite += finite
    acc.sat += sat
    if finite:
        acc.minmax(mn, mx)
        acc.sums.append(s)
        acc.sqs.append(q)
        acc.abss.append(a)


def _attach(mod: ModuleType, sc: Scratch) -> bytearray:
    """The worker's C state, created on its first block; its flush folds it into the Acc."""
    st = mod.state()
    sc.cstate = st
    sc.cflush = lambda acc: fold(mod.take(st), acc)
    return st


def block_fn(mod: ModuleType, a: np.ndarray, bf16: bool, fallback: BlockFn) -> BlockFn | None:
    """A block function running ``mod``'s kernel for ``a``'s dtype, or None where the C kernel
    has none (integers, bool, long double): the caller keeps the numpy kernel then.
    ``fallback`` is the numpy kernel, used for any block the C kernel declines."""
    if bf16:
        kernel = mod.bf16
    elif not a.dtype.isnative:
        return None
    elif a.dtype == np.float16:
        kernel = mod.f16
    elif a.dtype == np.float32:
        kernel = mod.f32
    elif a.dtype == np.float64:
        kernel = mod.f64
    else:
        return None

    def fn(b: np.ndarray, acc: Acc, sc: Scratch) -> None:
        st = sc.cstate
        if st is None:
            st = _attach(mod, sc)
        if not kernel(b, st):
            fallback(b, acc, sc)

    return fn
