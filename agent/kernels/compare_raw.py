"""A compare the C kernel takes whole, on flat buffers of words and without numpy: the path of
``compare_c.two_pass`` for a pair whose every block the kernel reads (float32, float16,
bfloat16; native, aligned, contiguous; no NaN/Inf in any block that differs), its calls and
their order the same, so every metric comes out bit for bit as ``compare_arrays`` gives it for
the same data (tests/kernels/test_compare_raw.py holds the two side by side).

Where ``two_pass`` would hand a block to numpy (a block holding NaN/Inf, an identical block
whose sum is not finite, a KLD term the kernel declines) or would fall back to the one-pass
flow, :func:`passes` answers None and the caller compares the numpy arrays instead: the rare
pairs pay numpy's import, the common ones do not (kernels/lazy.py).
"""

from __future__ import annotations

import math
from types import ModuleType

from .compare_c import BF16, F16, F32, _pass2_whole, take, takes_whole, terms_of_same
from .compare_numpy import Acc, Kld, Range

KINDS = {"f4": F32, "f2": F16, "bf16": BF16}


def passes(mod: ModuleType, x: memoryview, y: memoryview, code_x: str, code_y: str,
           n: int) -> tuple[Acc, Kld | None] | None:
    """Pass 1 and pass 2 of ``two_pass`` over whole buffers ``x`` (target) and ``y`` (bench) of
    equal, non-zero length, in blocks of ``n`` elements: the accumulated partials and the KLD
    (None: every block identical), or None where numpy's path must take the pair."""
    kx, ky = KINDS.get(code_x), KINDS.get(code_y)
    if kx is None or ky is None or not takes_whole(mod, kx, ky) or len(x) != len(y) or not len(x):
        return None
    same_dtype = code_x == code_y
    acc = Acc()
    acc.bitwise = same_dtype
    ranges: dict[int, tuple[Range, Range]] = {}
    block_sums: dict[int, tuple[float, float]] = {}
    try:
        rows = mod.blocks(x, y, kx, ky, n, same_dtype, True, acc.mad)
    except (ValueError, BufferError):   # misaligned words: numpy's path copies them
        return None
    size = len(x)
    for k, r in enumerate(rows):
        off = k * n
        if r is None:   # NaN/Inf in a differing block: numpy's policy
            return None
        if len(r) == 2:   # bytes equal on both sides: (Σx, Σx²), as identical_block takes them
            s, q = r
            if not math.isfinite(s):
                return None
            m = min(n, size - off)
            acc.sx.append(s), acc.sy.append(s)
            acc.sxx.append(q), acc.syy.append(q), acc.sxy.append(q)
            acc.c1 += m
            acc.c5 += m
            acc.kld_todo.append((off, m, s))
            continue
        acc.bitwise = False
        ranges[off] = take(r, off, acc, None, block_sums)
    if not ranges:
        return acc, None
    todo = [off for off, _, _ in acc.kld_todo]
    for off in todo:   # identical blocks: one side's range
        try:
            r = mod.range(x[off:off + n], kx)
        except (ValueError, BufferError):
            return None
        if r is None:
            return None
        ranges[off] = (r, r)
    kld = Kld(None, None, None, None, n, None, ranges=ranges)   # type: ignore[arg-type]  # ranges given
    if not _pass2_whole(mod, kx, ky, (x, y), n, kld, set(todo), block_sums):
        return None
    # revisit_identical: the identical blocks' KLD terms, from Σx where it can, else the kernel's
    for off in [off for off, m, s in acc.kld_todo if not kld.same_free(off, m, s)]:
        if not terms_of_same(mod, kx, x[off:off + n], kld, off):
            return None
    return acc, kld
