"""Scan a tensor that lies in a file, in bounded windows, leaving the page cache as it was found.

The file-level entry points of the scanner (:func:`scan_region`, :func:`scan_file_npy`); the
array kernels and their dispatch are :mod:`.scanner` (this module imports it, never the other way).

A plain stretch of a file (:class:`.types.FileRegion`) is read window by window (``WINDOW_BYTES``
per worker, at most ``MAPPED_BYTES`` over all workers, each a whole number of scanner blocks).
Each window is mapped (which reads nothing) to ask the kernel which of its pages are in the page
cache (:func:`.pagecache.resident`). Then:

* all of them cached (a dump just written is) and the file held by a read lease
  (:class:`.pagecache.ReadLease`: no one can truncate it meanwhile, so no SIGBUS): the blocks are
  scanned in place in the mapping, no copy; the window is unmapped after, so RSS stays bounded
  (mapped pages count in RSS while mapped);
* otherwise (pages to read from disk, no lease, a misaligned start, ``PRECISION_AGENT_SCAN_READ=
  pread``): ``pread`` into one reused ``CHUNK_BYTES`` buffer per worker; a file that shrinks under
  us is a short read (a DumpError), never a SIGBUS. A lease that someone asks to break mid-window
  is let go at once and the rest of the window is read this way.

Pages that were not cached before the window was read are dropped after it
(``posix_fadvise(POSIX_FADV_DONTNEED)``), so scanning does not push the training job's pages out;
pages found cached stay, unless the caller keeps everything for a comparison that reads the same
files next (``drop_cache=False``). Deflated zip members (``.npz``, ``torch.save`` files) are
inflated as a stream into a bounded buffer: never more than a chunk held, never more inflated
than the tensor's shape and dtype need.

Every path hands the kernels exactly the blocks :func:`.scanner.scan_array` would cut from the
whole array (same spans per thread, same block boundaries), so the statistics are bit-identical
whatever the path, window or chunk size.
"""

from __future__ import annotations

import mmap
import os
import threading
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from itertools import islice
from typing import Callable, Iterator

import numpy as np

from ..health import beat
from ..kernels.scan_numpy import ROW, Acc, Scratch
from ..model import TensorStats
from ..safeio import open_regular_file
from .pagecache import PAGE, ReadLease, drop_absent, page_span, resident
from .scanner import DEFAULT_BLOCK, _ranges, _run, kernel_for, stats_of
from .types import DumpError, FileRegion, ZipRegion

__all__ = ["CHUNK_BYTES", "MAPPED_BYTES", "WINDOW_BYTES", "read_counts", "scan_file_npy", "scan_region"]

CHUNK_BYTES = 4 << 20           # pread buffer per worker; rounded to whole blocks
WINDOW_BYTES = 32 << 20         # mapped window per worker (the unit of residency checks and drops)
MAPPED_BYTES = 128 << 20        # mapped over all workers at once
READ_ENV = "PRECISION_AGENT_SCAN_READ"   # "auto" (default) or "pread": never scan in a mapping

OnBytes = Callable[[int], None]
_COUNTS = {"mapped": 0, "copied": 0, "inflated": 0, "dropped": 0}
_lock = threading.Lock()


def read_counts() -> dict[str, int]:
    """Bytes of tensor data scanned in place (``mapped``), through the pread buffer (``copied``),
    inflated from zip members, and bytes of pages dropped from the page cache, since start."""
    with _lock:
        return dict(_COUNTS)


def _count(**kw: int) -> None:
    with _lock:
        for k, v in kw.items():
            _COUNTS[k] += v


def _elems(n: int, itemsize: int, nbytes: int) -> int:
    """Whole blocks of ``n`` elements in about ``nbytes`` (at least one block)."""
    return n * max(1, nbytes // max(1, n * itemsize))


def _swap(dt: np.dtype, bf16: bool) -> tuple[np.dtype, bool]:
    """(dtype the kernels see, whether blocks need a byte swap first): as ``scan_array`` does it."""
    if bf16:
        return np.dtype(np.uint16), False   # raw words, viewed as native uint16 (no swap)
    if not dt.isnative:
        return dt.newbyteorder("="), True
    return dt, False


def _map(fd: int, start: int, end: int) -> mmap.mmap | None:
    """A read-only shared map of bytes ``start`` (a page boundary) to ``end`` of ``fd``; None where
    there is nothing to map or the file cannot be mapped. Mapping reads nothing."""
    if end <= start:
        return None
    try:
        return mmap.mmap(fd, end - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start)
    except (OSError, ValueError, OverflowError):
        return None


class _Span:
    """One worker's pass over elements ``lo..hi`` of a file region: its accumulator, scratch,
    descriptor, lease and pread buffer."""

    def __init__(self, reg: FileRegion, n: int, fn: Callable, row: int, work: np.dtype, swap: bool,
                 on_bytes: OnBytes | None, scratch: int) -> None:
        self.reg, self.n, self.fn, self.work, self.swap, self.on_bytes = reg, n, fn, work, swap, on_bytes
        self.isz = reg.dtype.itemsize
        self.acc, self.sc = Acc(), Scratch(scratch, row)   # sized as scan_array's worker sizes it
        self.buf: np.ndarray | None = None

    def blocks(self, arr: np.ndarray, start: int, stop: int, lease: ReadLease | None = None) -> int:
        """Scan ``arr[start:stop]`` block by block; with a ``lease``, only while it holds.
        Returns where it stopped."""
        n, fn, acc, sc = self.n, self.fn, self.acc, self.sc
        for i in range(start, stop, n):
            if lease is not None and not lease.held():
                return i
            b = arr[i:min(i + n, stop)]
            fn(b.astype(self.work) if self.swap else b, acc, sc)
            if self.on_bytes is not None:
                self.on_bytes(b.size * self.isz)
        return stop

    def pread(self, fd: int, c0: int, c1: int, per: int) -> None:
        """Elements ``c0..c1`` (block-aligned) read into the reused buffer, ``per`` at a time."""
        isz, reg = self.isz, self.reg
        need = min(per, c1 - c0) * isz
        if self.buf is None or self.buf.size < need:
            self.buf = np.empty(need, dtype=np.uint8)
        for p0 in range(c0, c1, per):
            p1 = min(c1, p0 + per)
            want = (p1 - p0) * isz
            view = memoryview(self.buf)[:want]
            got, off = 0, reg.offset + p0 * isz
            while got < want:
                k = os.preadv(fd, [view[got:]], off + got)
                if k <= 0:
                    raise DumpError(f"{reg.path}: file ended at byte {off + got}, the tensor needs "
                                    f"{reg.offset + reg.count * isz} (it shrank while being read?)")
                got += k
            self.blocks(self.buf[:want].view(reg.dtype), 0, p1 - p0)
            _count(copied=want)

    def run(self, lo: int, hi: int, window: int, drop_cache: bool, in_place: bool) -> Acc:
        reg, isz = self.reg, self.isz
        win = _elems(self.n, isz, window)
        pages = lambda c0: page_span(reg.offset + c0 * isz, reg.offset + min(hi, c0 + win) * isz)  # noqa: E731
        with open_regular_file(reg.path) as fh, np.errstate(all="ignore"):
            fd = fh.fileno()
            lease: ReadLease | None = ReadLease(fd) if in_place else None
            if lease is not None and not lease.taken:
                lease = None
            try:
                # which pages were cached before we read: taken for the whole span at once, since
                # the kernel's read-ahead for one window brings in the next ones' pages
                first, _ = pages(lo)
                was = _residency(fd, first, page_span(0, reg.offset + hi * isz)[1]) if drop_cache else None
                for c0 in range(lo, hi, win):
                    self.window(fd, c0, min(hi, c0 + win), lease)
                    if drop_cache:
                        base, ceil = pages(c0)
                        part = None if was is None else was[(base - first) // PAGE:]
                        _count(dropped=drop_absent(fd, base, part, ceil))
                    beat()
            finally:
                if lease is not None:
                    lease.release()
        self.sc.flush(self.acc)
        return self.acc

    def window(self, fd: int, c0: int, c1: int, lease: ReadLease | None) -> None:
        """Elements ``c0..c1``: in place in a mapping where that is safe, else (or from where a
        lease was given up) through the pread buffer."""
        reg, isz, done = self.reg, self.isz, c0
        start, end = reg.offset + c0 * isz, reg.offset + c1 * isz
        base, ceil = page_span(start, end)
        size = os.fstat(fd).st_size
        if lease is not None and end <= size:  # with the lease held it cannot shrink now
            mm = _map(fd, base, min(ceil, size))   # (Python maps nothing past the end)
            try:
                now = resident(mm) if mm is not None else None
                # in place where the pages inside are cached now (the two ends may be shared with
                # the windows beside): no disk reads while the lease holds
                if mm is not None and now is not None and now[1:-1].all() and lease.held():
                    mm.madvise(mmap.MADV_SEQUENTIAL)   # our reads do not make its pages "hot"
                    arr = np.frombuffer(mm, dtype=reg.dtype, count=c1 - c0, offset=start - base)
                    try:
                        done = c0 + self.blocks(arr, 0, c1 - c0, lease)
                    finally:
                        del arr
                    _count(mapped=(done - c0) * isz)
            finally:
                if mm is not None:
                    try:
                        mm.close()
                    except BufferError:  # a view still held by a traceback: unmapped when it goes
                        pass
        if done < c1:
            self.pread(fd, done, c1, _elems(self.n, isz, CHUNK_BYTES))


def _residency(fd: int, start: int, end: int) -> "np.ndarray | None":
    """Which pages of bytes ``start..end`` (page boundaries) of ``fd`` are cached now."""
    mm = _map(fd, start, min(end, os.fstat(fd).st_size))
    if mm is None:
        return None
    with mm:
        return resident(mm)


def _zip_blocks(reg: ZipRegion, n: int, work: np.dtype, swap: bool, drop_cache: bool) -> Iterator[np.ndarray]:
    """Every block of ``reg`` in order, inflated as a stream into one reused buffer."""
    isz = reg.dtype.itemsize
    per = _elems(n, isz, CHUNK_BYTES)
    buf = np.empty(min(per, reg.count) * isz, dtype=np.uint8)
    with open_regular_file(reg.path) as fh:
        fd = fh.fileno()
        size = os.fstat(fd).st_size
        was = _residency(fd, 0, size) if drop_cache else None
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
                    _count(inflated=want)
                    beat()
        except DumpError:
            raise
        except (zipfile.BadZipFile, EOFError, ValueError, RuntimeError, KeyError, NotImplementedError) as exc:
            raise DumpError(f"{reg.path}:{reg.member}: cannot inflate: {exc}") from None
        except zlib.error as exc:
            raise DumpError(f"{reg.path}:{reg.member}: corrupt member: {exc}") from None
        if drop_cache:  # the whole (compressed) file: it is small next to its tensor
            _count(dropped=drop_absent(fd, 0, was, size))


def _counted(blocks: Iterator[np.ndarray], on_bytes: OnBytes | None, itemsize: int) -> Iterator[np.ndarray]:
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
                on_bytes: OnBytes | None = None, read: str | None = None,
                window_bytes: int | None = None) -> TensorStats:
    """Statistics of the tensor in ``reg``, equal to ``scan_array`` of the whole array.
    ``on_bytes(n)``: progress, n bytes of the tensor at a time (from several threads).
    ``read``: "auto" (scan cached windows in place where safe) or "pread" (never); default from
    ``PRECISION_AGENT_SCAN_READ``. ``window_bytes``: mapped window per worker (default
    ``WINDOW_BYTES``, within ``MAPPED_BYTES`` over all workers)."""
    if block_elems < 1 or threads < 1:
        raise ValueError("block_elems and threads must be >= 1")
    read = read or os.environ.get(READ_ENV, "auto") or "auto"
    if read not in ("auto", "pread"):
        raise ValueError(f"{READ_ENV} / read must be 'auto' or 'pread', not {read!r}")
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
        window = window_bytes or min(WINDOW_BYTES, MAPPED_BYTES // len(spans))
        # in place only where the kernels see what an aligned buffer would give them
        in_place = read == "auto" and (swap or reg.offset % reg.dtype.itemsize == 0)

        def part(span: tuple[int, int]) -> Acc:
            lo, hi = span
            return _Span(reg, n, fn, row, work, swap, on_bytes, min(n, hi - lo)).run(lo, hi, window, drop_cache,
                                                                                  in_place)
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


def scan_file_npy(path: str, *, dtype: str | None = None, name: str = "", io: str = "",
                  index: int = 0, block_elems: int = DEFAULT_BLOCK, threads: int = 1,
                  drop_cache: bool = True, read: str | None = None) -> TensorStats:
    """Scan a .npy file in bounded windows (see the module docstring): never mapped or loaded whole."""
    from .npy import read_npy
    region = read_npy(path).region()  # type: ignore[misc]
    return scan_region(region, dtype=dtype, name=name, io=io, index=index, block_elems=block_elems,
                       threads=threads, path=str(path), drop_cache=drop_cache, read=read)
