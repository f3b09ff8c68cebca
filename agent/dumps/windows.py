"""Scan a tensor that lies in a file, in bounded windows, leaving the page cache as it was found.

The file-level entry points of the scanner (:func:`scan_region`, :func:`scan_file_npy`); the
array kernels and their dispatch are :mod:`.scanner` (this module imports it, never the other way).

A plain stretch of a file (:class:`.types.FileRegion`) is read window by window (``WINDOW_BYTES``
per worker, each a whole number of scanner blocks; at most ``MAPPED_BYTES`` mapped at once in the
process, over all workers and all scans running side by side).
Before the first read, the kernel is asked which pages of every window are in the page cache
(:func:`.pagecache.snapshot`: ``cachestat``, else ``mincore``; the read-ahead of one window would
make the next ones look cached later). Then, per window:

* with ``read="map"`` (``PRECISION_AGENT_SCAN_READ=map``; the default is ``pread``, measured
  faster end to end on the 2-vCPU host, bench/README.md), a window that was cached (a dump just
  written is; at least 7/8 of its pages: reclaim takes single pages here and there) while the
  file is held by a read lease (:class:`.pagecache.ReadLease`: no one can truncate it meanwhile,
  so no SIGBUS) is scanned in place in a mapping of the window, no copy; it is unmapped after,
  so RSS stays bounded (mapped pages count in RSS while mapped);
* otherwise (the default, pages to read from disk, no lease, a misaligned start, no room in the
  process's mapped-bytes budget): ``pread`` into one reused ``CHUNK_BYTES`` buffer per worker; a
  file that shrinks under us is a short read (a DumpError), never a SIGBUS. A lease that someone
  asks to break mid-window is let go at once and the rest of the window is read this way.

After each window, its pages that were not cached before are dropped again
(``posix_fadvise(POSIX_FADV_DONTNEED)``), so scanning does not push the training job's pages out;
pages found cached stay. ``drop_cache=False`` keeps everything (a comparison reads the same files
next). Deflated zip members (``.npz``, ``torch.save`` files) are inflated as a stream into a
bounded buffer: never more than a chunk held, never more inflated than the tensor's shape and
dtype need.

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

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from ..health import beat
from ..kernels.scan_numpy import ROW, Acc, Scratch
from ..model import TensorStats
from ..safeio import open_regular_file
from .pagecache import PAGE, ReadLease, drop_absent, mostly_cached, page_span, snapshot
from .scanner import DEFAULT_BLOCK, _ranges, _run, kernel_for, stats_of
from .types import DumpError, FileRegion, ZipRegion

__all__ = ["CHUNK_BYTES", "MAPPED_BYTES", "WINDOW_BYTES", "read_buffer", "read_counts", "scan_file_npy", "scan_region"]

CHUNK_BYTES = 4 << 20           # pread buffer per worker; rounded to whole blocks
WINDOW_BYTES = 32 << 20         # mapped window per worker (the unit of residency checks and drops)
MAPPED_BYTES = 128 << 20        # mapped at once over all workers and scans of the process
READ_ENV = "PRECISION_AGENT_SCAN_READ"   # "pread" (default) or "map": cached windows in place
DEFAULT_READ = "pread"          # measured faster end to end on the 2-vCPU host (bench/README.md, scan)

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


class _Budget:
    """Bytes that may be mapped at once in this process, over every scan and worker (scans of
    several files may run side by side): a window that does not fit is read with pread."""

    def __init__(self, total: int) -> None:
        self.left = total
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self.left:
                return False
            self.left -= n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.left += n


_MAPPED = _Budget(MAPPED_BYTES)


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


def read_buffer(nbytes: int, file_offset: int) -> np.ndarray:
    """A ``pread`` buffer whose start lies at the same place in its page as ``file_offset`` in
    its page (64-byte aligned: the kernels' alignment), so that the kernel's copy from the page
    cache never writes 16 bytes ahead of where it reads modulo 4 KiB: a store then aliases the
    next load (4K aliasing) and ``pread`` copies about 3x slower (bench/README ``scantree``: a
    fresh process's first 4 MiB buffers were mapped by malloc at 16 bytes into a page). Reads
    at ``file_offset`` plus whole pages keep that placement."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    want = file_offset % PAGE // 64 * 64
    start = (want - raw.ctypes.data) % PAGE
    return raw[start:start + nbytes]


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
            self.buf = read_buffer(need, reg.offset + c0 * isz)
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
        starts = range(lo, hi, win)
        pages = [page_span(reg.offset + c0 * isz, reg.offset + min(hi, c0 + win) * isz) for c0 in starts]
        with open_regular_file(reg.path) as fh, np.errstate(all="ignore"):
            fd = fh.fileno()
            lease: ReadLease | None = ReadLease(fd) if in_place else None
            if lease is not None and not lease.taken:
                lease = None
            try:
                # what was cached before we read, for every window at once: the kernel's
                # read-ahead for one window brings in the next ones' pages
                was = snapshot(fd, pages) if drop_cache or lease is not None else [None] * len(pages)
                for c0, (base, ceil), cached in zip(starts, pages, was):
                    self.window(fd, c0, min(hi, c0 + win), lease if mostly_cached(cached) else None)
                    if drop_cache:
                        _count(dropped=drop_absent(fd, base, cached, ceil))
                    beat()
            finally:
                if lease is not None:
                    lease.release()
        self.sc.flush(self.acc)
        return self.acc

    def window(self, fd: int, c0: int, c1: int, lease: ReadLease | None) -> None:
        """Elements ``c0..c1``: in place in a mapping where that is safe (a ``lease`` is given for a
        window whose pages were mostly cached; the few others are read by page faults), else (or from where the lease was given up) through the
        pread buffer."""
        reg, isz, done = self.reg, self.isz, c0
        start, end = reg.offset + c0 * isz, reg.offset + c1 * isz
        base = start // PAGE * PAGE
        budget = _MAPPED
        if lease is not None and end <= os.fstat(fd).st_size and lease.held() and budget.take(end - start):
            # the lease holds: the file cannot shrink below ``end`` while it does
            mm = _map(fd, base, end)
            if mm is None:
                budget.give(end - start)
            else:
                try:
                    mm.madvise(mmap.MADV_SEQUENTIAL)   # our reads do not make its pages "hot"
                    arr = np.frombuffer(mm, dtype=reg.dtype, count=c1 - c0, offset=start - base)
                    try:
                        done = c0 + self.blocks(arr, 0, c1 - c0, lease)
                    finally:
                        del arr
                    _count(mapped=(done - c0) * isz)
                finally:
                    try:
                        mm.close()
                    except BufferError:  # a view still held by a traceback: unmapped when it goes
                        pass
                    budget.give(end - start)
        if done < c1:
            self.pread(fd, done, c1, _elems(self.n, isz, CHUNK_BYTES))


def _zip_blocks(reg: ZipRegion, n: int, work: np.dtype, swap: bool, drop_cache: bool) -> Iterator[np.ndarray]:
    """Every block of ``reg`` in order, inflated as a stream into one reused buffer."""
    isz = reg.dtype.itemsize
    per = _elems(n, isz, CHUNK_BYTES)
    buf = np.empty(min(per, reg.count) * isz, dtype=np.uint8)
    with open_regular_file(reg.path) as fh:
        fd = fh.fileno()
        size = os.fstat(fd).st_size
        pages = [page_span(0, size)] if size else []
        [was] = snapshot(fd, pages) if drop_cache and pages else [None]
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
    ``read``: "map" (scan cached windows in place where safe) or "pread" (never); default from
    ``PRECISION_AGENT_SCAN_READ``. ``window_bytes``: mapped window per worker (default
    ``WINDOW_BYTES``, within ``MAPPED_BYTES`` over all workers)."""
    if block_elems < 1 or threads < 1:
        raise ValueError("block_elems and threads must be >= 1")
    read = read or os.environ.get(READ_ENV, DEFAULT_READ) or DEFAULT_READ
    if read not in ("map", "pread"):
        raise ValueError(f"{READ_ENV} / read must be 'pread' or 'map', not {read!r}")
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
        in_place = read == "map" and (swap or reg.offset % reg.dtype.itemsize == 0)

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
