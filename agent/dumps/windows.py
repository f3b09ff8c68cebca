"""Scan a tensor that lies in a file through a bounded, reused buffer.

Mapping a whole dump file makes the agent's RSS (as ``ps``, cgroups and
``process_resident_memory_bytes`` see it) grow to the file size, and reading it evicts the
training job's page cache. Here the data is read with ``pread`` into one reused buffer per
worker (``CHUNK_BYTES``, a whole number of scanner blocks), so RSS stays bounded whatever the
file size; a file that shrinks under us is a short read (an error), never a SIGBUS. The pages
read are dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``) unless the caller
keeps them for a comparison that will read the same files next (``drop_cache=False``).

Deflated zip members (``.npz``, ``torch.save`` files) are inflated as a stream into the same
kind of buffer: never more than a chunk is held, whatever the member inflates to, and never more
than the bytes the tensor's shape and dtype need are inflated.

The blocks handed to the kernels are exactly those :func:`.scanner.scan_array` would cut from the
whole array (same spans per thread, same block boundaries), so the statistics are identical.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Callable, Iterator

import numpy as np

from ..health import beat
from ..model import TensorStats
from ..safeio import open_regular_file
from ..kernels.scan_numpy import ROW, Acc
from .scanner import DEFAULT_BLOCK, _ranges, _run, kernel_for, stats_of
from .types import DumpError, FileRegion, ZipRegion

CHUNK_BYTES = 4 << 20           # per worker; rounded to whole blocks
_FADVISE_BYTES = 64 << 20       # drop read pages from the page cache about this often


def _chunk_elems(n: int, itemsize: int) -> int:
    return n * max(1, CHUNK_BYTES // max(1, n * itemsize))


def _swap(dt: np.dtype, bf16: bool) -> tuple[np.dtype, bool]:
    """(dtype the kernels see, whether blocks need a byte swap first): as ``scan_array`` does it."""
    if bf16:
        return np.dtype(np.uint16), False   # raw words, viewed as native uint16 (no swap)
    if not dt.isnative:
        return dt.newbyteorder("="), True
    return dt, False


def _drop(fd: int, off: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):  # pragma: no cover - advisory only
        pass


def _file_blocks(reg: FileRegion, lo: int, hi: int, n: int, work: np.dtype, swap: bool,
                 drop_cache: bool) -> Iterator[np.ndarray]:
    """Blocks of ``n`` elements of ``reg`` from element ``lo`` to ``hi``, read with pread into
    one reused buffer."""
    isz = reg.dtype.itemsize
    per = _chunk_elems(n, isz)
    buf = np.empty(min(per, hi - lo) * isz, dtype=np.uint8)
    with open_regular_file(reg.path) as fh:
        fd = fh.fileno()
        dropped = reg.offset + lo * isz
        for c0 in range(lo, hi, per):
            c1 = min(hi, c0 + per)
            want = (c1 - c0) * isz
            view = memoryview(buf)[:want]
            got, off = 0, reg.offset + c0 * isz
            while got < want:
                k = os.preadv(fd, [view[got:]], off + got)
                if k <= 0:
                    raise DumpError(f"{reg.path}: file ended at byte {off + got}, the tensor needs "
                                    f"{reg.offset + reg.count * isz} (it shrank while being read?)")
                got += k
            arr = buf[:want].view(reg.dtype)
            for i in range(0, c1 - c0, n):
                b = arr[i:i + n]
                yield b.astype(work) if swap else b
            end = off + want
            if drop_cache and (end - dropped >= _FADVISE_BYTES or c1 == hi):
                _drop(fd, dropped, end - dropped)
                dropped = end
            beat()


def _zip_blocks(reg: ZipRegion, n: int, work: np.dtype, swap: bool, drop_cache: bool) -> Iterator[np.ndarray]:
    """Every block of ``reg`` in order, inflated as a stream into one reused buffer."""
    isz = reg.dtype.itemsize
    per = _chunk_elems(n, isz)
    buf = np.empty(min(per, reg.count) * isz, dtype=np.uint8)
    with open_regular_file(reg.path) as fh:
        try:
            with zipfile.ZipFile(fh) as zf, zf.open(reg.member) as src:
                left = reg.skip
                while left > 0:  # the npy header before the data
                    k = len(src.read(min(left, 1 << 16)))
                    if k == 0:
                        raise DumpError(f"{reg.path}:{reg.member}: member ends inside its header")
                    left -= k
                for c0 in range(0, reg.count, per):
                    c1 = min(reg.count, c0 + per)
                    want = (c1 - c0) * isz
                    got = 0
                    while got < want:
                        data = src.read(min(want - got, 1 << 20))
                        if not data:
                            raise DumpError(f"{reg.path}:{reg.member}: member inflates to "
                                            f"{reg.skip + c0 * isz + got} bytes, the tensor needs "
                                            f"{reg.skip + reg.count * isz}")
                        buf[got:got + len(data)] = np.frombuffer(data, dtype=np.uint8)
                        got += len(data)
                    arr = buf[:want].view(reg.dtype)
                    for i in range(0, c1 - c0, n):
                        b = arr[i:i + n]
                        yield b.astype(work) if swap else b
                    beat()
        except DumpError:
            raise
        except (zipfile.BadZipFile, EOFError, ValueError, RuntimeError, KeyError, NotImplementedError) as exc:
            raise DumpError(f"{reg.path}:{reg.member}: cannot inflate: {exc}") from None
        except zlib.error as exc:
            raise DumpError(f"{reg.path}:{reg.member}: corrupt member: {exc}") from None
        if drop_cache:
            _drop(fh.fileno(), 0, 0)  # the whole (compressed) file: it is small next to its tensor


def _counted(blocks: Iterator[np.ndarray], on_bytes: Callable[[int], None] | None, itemsize: int,
             ) -> Iterator[np.ndarray]:
    """``blocks`` as they are, telling ``on_bytes`` how much of the file each one covered."""
    if on_bytes is None:
        yield from blocks
        return
    for b in blocks:
        yield b
        on_bytes(b.size * itemsize)


def scan_region(reg: FileRegion | ZipRegion, *, dtype: str | None = None, name: str = "", io: str = "",
                index: int = 0, block_elems: int = DEFAULT_BLOCK, threads: int = 1, drop_cache: bool = True,
                step: int | None = None, rank: int | None = None, path: str = "",
                on_bytes: Callable[[int], None] | None = None) -> TensorStats:
    """Statistics of the tensor in ``reg``, equal to ``scan_array`` of the whole array.
    ``on_bytes(n)``: progress, n bytes of the tensor at a time (from several threads)."""
    if block_elems < 1 or threads < 1:
        raise ValueError("block_elems and threads must be >= 1")
    bf16 = dtype == "bfloat16" or reg.dtype.name == "bfloat16"
    if bf16 and reg.dtype.itemsize != 2:
        raise TypeError(f"bfloat16 data must come as 16-bit words, got {reg.dtype}")
    kind_name = "bfloat16" if bf16 else (dtype or reg.dtype.name)
    work, swap = _swap(reg.dtype, bf16)
    if bf16:
        reg = replace(reg, dtype=work)
    fn: Callable = kernel_for(work, bf16)
    n, count = int(block_elems), reg.count
    row = max(1, min(ROW, n))
    spans = _ranges(count, n, int(threads)) if count else []
    parts = [Acc()]
    if not spans:
        pass
    elif isinstance(reg, FileRegion):
        def part(span: tuple[int, int]) -> Acc:
            lo, hi = span
            return _run(_counted(_file_blocks(reg, lo, hi, n, work, swap, drop_cache), on_bytes, reg.dtype.itemsize),
                        fn, min(n, hi - lo), row)
        if len(spans) == 1:
            parts = [part(spans[0])]
        else:
            with ThreadPoolExecutor(max_workers=len(spans), thread_name_prefix="scan") as pool:
                parts = list(pool.map(part, spans))
    else:  # one stream: the spans one after the other, each with its own accumulator
        raw = _zip_blocks(reg, n, work, swap, drop_cache)
        blocks = _counted(raw, on_bytes, reg.dtype.itemsize)
        parts = [_run(islice(blocks, -(-(hi - lo) // n)), fn, min(n, hi - lo), row) for lo, hi in spans]
        blocks.close()
        raw.close()
    acc = parts[0]
    for p in parts[1:]:
        acc.merge(p)
    return stats_of(acc, count, kind_name, reg.shape, name=name, io=io, index=index, step=step, rank=rank,
                    path=path)
