"""One tensor's statistics, given by its dump or from one pass of the scanner, and what that
pass reads: what ``scan`` computes for every tensor and ``compare`` for the few its verdict names
(apart from scan.py, which imports every reader, the Opdebug decoder and the daemon's cache)."""

from __future__ import annotations

import math
import threading
from dataclasses import replace
from typing import Callable

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from ..model import TensorStats
from .scanner import scan_array
from .types import DumpError, DumpTensor
from .windows import scan_region


# the common dtypes' sizes, known without numpy's import (compare's progress bar asks for every pair)
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}


def tensor_bytes(t: DumpTensor) -> int:
    """How many bytes of data one pass over ``t`` reads (0 for statistics-only tensors)."""
    if t.load is None:
        return 0
    size = _ITEMSIZE.get(t.dtype)
    if size is None:
        try:
            size = np.dtype(t.dtype).itemsize
        except TypeError:
            size = 1
    return math.prod(t.shape) * size


def statistics(t: DumpTensor, threads: int = 1, on_bytes: Callable[[int], None] | None = None,
               drop_cache: bool = True) -> TensorStats:
    """The tensor's statistics: given by the dump, or computed in one pass over its data (read in
    bounded chunks where the data lies in a file: agent/dumps/windows.py; ``drop_cache``: drop
    the pages read from the page cache). ``on_bytes(n)``: called as the pass advances, n bytes at
    a time."""
    if t.load is None:
        if t.stats is None:
            raise DumpError(f"{t.path or t.name}: neither data nor statistics")
        return replace(t.stats, step=t.step, rank=t.rank, path=t.path)
    advance = counted = None
    if on_bytes is not None:
        lock = threading.Lock()

        def counted(n: int) -> None:
            with lock:
                on_bytes(n)

        def advance(start: int, end: int) -> None:   # the scanner's page-release hook
            counted(end - start)
    region = t.region() if t.region is not None else None
    if region is not None:
        s = scan_region(region, dtype=t.dtype, name=t.name, io=t.io, index=t.index, threads=threads,
                        drop_cache=drop_cache, on_bytes=counted)
    else:
        s = scan_array(t.load(), dtype=t.dtype, name=t.name, io=t.io, index=t.index, threads=threads,
                       _release=advance)
    return replace(s, step=t.step, rank=t.rank, path=t.path)
