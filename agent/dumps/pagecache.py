"""What the dump scanner needs from the OS to read a file in place and leave the page cache as
it found it: which pages of a range are cached (``mincore``), dropping pages (``posix_fadvise``),
and a read lease that keeps a mapped file from being truncated under the mapping.

A page of a shared file mapping that the file no longer covers raises SIGBUS when touched, and
Python cannot survive a SIGBUS. :class:`ReadLease` rules that out: while the lease is held, a
process that opens the file for writing or truncates it waits in the kernel (for at most
``/proc/sys/fs/lease-break-time``, 45 s by default) until the holder lets go, and
:meth:`ReadLease.held` turns False as soon as such a wait begins; the scanner asks before every
block it reads through a mapping and lets go at once (then reads what is left with ``pread``, where
a shorter file is a short read, an error). A lease is only taken where it protects: a local
file system (leases are local, a network file system's other clients do not see them), no
writer holding the file open, a process allowed to take one (the file's owner, or
CAP_LEASE), and a signal to be told by that nothing handles (``SIGURG``, ignored by default: the
default lease signal, SIGIO, would kill the process). Anywhere else the scanner reads with
``pread`` only.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import signal
import sys

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

PAGE = mmap.PAGESIZE
F_SETSIG, F_SETLEASE, F_GETLEASE = 10, 1024, 1025       # Linux <fcntl.h>
LEASE_SIGNAL = signal.SIGURG
# statfs f_type of the local file systems where a lease covers every writer (linux/magic.h)
LOCAL_FS = {0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x01021994: "tmpfs",
            0xF2F52010: "f2fs", 0x2FC12FC1: "zfs", 0xCA451A4E: "bcachefs"}

def _load_libc() -> ctypes.CDLL:
    """glibc's by its soname; elsewhere (musl) the one ``find_library`` names, whose search
    (``ldconfig -p`` in a child process, ~10 ms) every command importing this module paid."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        from ctypes.util import find_library
        return ctypes.CDLL(find_library("c") or "libc.so", use_errno=True)


_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = _load_libc()
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
        _libc.syscall.restype = ctypes.c_long
    except (OSError, AttributeError):  # pragma: no cover - a libc without them
        _libc = None


def fs_type(fd: int) -> int | None:
    """``statfs.f_type`` of the file system holding ``fd`` (None where unknown)."""
    if _libc is None:
        return None
    buf = ctypes.create_string_buffer(256)       # struct statfs is 120 bytes on 64-bit Linux
    if _libc.fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF   # f_type: the first field, a long


def page_span(start: int, end: int) -> tuple[int, int]:
    """The whole pages covering bytes ``start..end`` of a file: (first page's offset, end)."""
    return start // PAGE * PAGE, -(-end // PAGE) * PAGE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(k, ctypes.c_uint64) for k in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                               "nr_recently_evicted")]


_CACHESTAT = 451          # the same number on every Linux architecture (5.x+ unified table)
_cachestat_ok = _libc is not None


def cached_count(fd: int, start: int, end: int) -> int | None:
    """How many pages of bytes ``start..end`` are in the page cache: ``cachestat`` (Linux 6.5+;
    about 5x cheaper than ``mincore``, it walks the cache without a mapping). None where the kernel
    lacks it or refuses (files one may not write and does not own, on kernels that restrict it)."""
    global _cachestat_ok
    if not _cachestat_ok or end <= start:
        return None if not _cachestat_ok else 0
    cs = _CacheStat()
    L = ctypes.c_long
    if _libc.syscall(L(_CACHESTAT), L(fd), ctypes.byref(_Range(start, end - start)), ctypes.byref(cs), L(0)) != 0:
        if ctypes.get_errno() == errno.ENOSYS:
            _cachestat_ok = False
        return None
    return int(cs.nr_cache)


def resident(mm: mmap.mmap) -> np.ndarray | None:
    """Per page of the mapping ``mm``: is it in the page cache? Touches no page (``mincore``).
    None where that cannot be known."""
    if _libc is None or len(mm) == 0:
        return None
    vec = np.zeros(-(-len(mm) // PAGE), dtype=np.uint8)
    addr = np.frombuffer(mm, dtype=np.uint8, count=1)
    try:
        rc = _libc.mincore(addr.ctypes.data, len(mm), vec.ctypes.data)
    finally:
        del addr  # the export must be gone before the map can be closed
    return (vec & 1).astype(bool) if rc == 0 else None


def resident_pages(fd: int, start: int, end: int, step: int = 128 << 20) -> np.ndarray | None:
    """Per page of bytes ``start..end`` (``start`` a page boundary) of ``fd``: cached now?
    (``mincore`` of a mapping that is never touched, ``step`` bytes at a time: address space may
    be capped too). None where unknown."""
    end = min(end, os.fstat(fd).st_size)
    parts = []
    for lo in range(start, end, step):
        try:
            mm = mmap.mmap(fd, min(end, lo + step) - lo, mmap.MAP_SHARED, mmap.PROT_READ, offset=lo)
        except (OSError, ValueError, OverflowError):
            return None
        with mm:
            part = resident(mm)
        if part is None:
            return None
        parts.append(part)
    return np.concatenate(parts) if parts else None


Cached = "bool | np.ndarray | None"   # all cached / none / a bool per page / unknown


def snapshot(fd: int, ranges: list[tuple[int, int]]) -> list[Cached]:
    """For each (page-aligned) byte range, what of it is in the page cache now: True (all),
    False (none), a bool per page (some), None (unknown). ``cachestat`` counts where the kernel
    has it (a per-page ``mincore`` only for ranges partly cached), else ``mincore``."""
    if not ranges:
        return []
    size = os.fstat(fd).st_size
    pages = lambda lo, hi: max(0, -(-(min(hi, size) - lo) // PAGE))  # noqa: E731
    whole = cached_count(fd, ranges[0][0], ranges[-1][1])
    if whole is not None and whole >= sum(pages(lo, hi) for lo, hi in _merged(ranges)):
        return [True] * len(ranges)
    out: list[Cached] = []
    for lo, hi in ranges:
        n = cached_count(fd, lo, hi) if whole is not None else None
        if n == 0:
            out.append(False)
        elif n is not None and n >= pages(lo, hi):
            out.append(True)
        else:
            out.append(resident_pages(fd, lo, hi))
    return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges in order, overlaps (shared edge pages) merged: what a count over all of them sees."""
    out = [ranges[0]]
    for lo, hi in ranges[1:]:
        if lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def mostly_cached(was: Cached, share: float = 0.875) -> bool:
    """``was`` (from :func:`snapshot`) says at least ``share`` of the pages are cached (reclaim
    takes single pages here and there: a window is not "on disk" for a few missing ones)."""
    if isinstance(was, np.ndarray):
        return bool(was.size) and float(was.mean()) >= share
    return was is True


def drop(fd: int, off: int, length: int) -> None:
    """Drop the pages of bytes ``off..off+length`` from the page cache (advice; whole pages)."""
    try:
        os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):  # pragma: no cover - advisory only
        pass


def drop_absent(fd: int, base: int, was: Cached, end: int) -> int:
    """Drop the pages from file offset ``base`` (a page boundary) to ``end`` that were not in the
    page cache before they were read (``was``, from :func:`snapshot`; None: drop all). Returns
    the bytes dropped."""
    if was is True:
        return 0
    if was is None or was is False:
        drop(fd, base, end - base)
        return end - base
    absent = ~was[:-(-(end - base) // PAGE)]
    if not absent.any():
        return 0
    # runs of absent pages: starts where absent begins, ends where it stops
    edges = np.flatnonzero(np.diff(np.concatenate(([False], absent, [False])).astype(np.int8)))
    for lo, hi in zip(edges[0::2], edges[1::2]):
        drop(fd, base + int(lo) * PAGE, int(hi - lo) * PAGE)
    return int(absent.sum()) * PAGE


class ReadLease:
    """A read lease on ``fd`` (opened read-only), taken where it keeps the file whole (see the
    module docstring). ``taken``: whether it was; :meth:`held` before each use of a mapping."""

    __slots__ = ("fd", "taken", "why")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.taken = False
        self.why = self._take()

    def _take(self) -> str:
        ft = fs_type(self.fd)
        if ft not in LOCAL_FS:
            return "not a local file system" if ft is not None else "file system unknown"
        if signal.getsignal(LEASE_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN):
            return f"{LEASE_SIGNAL.name} has a handler"
        try:
            fcntl.fcntl(self.fd, F_SETSIG, LEASE_SIGNAL)
            fcntl.fcntl(self.fd, F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:  # EAGAIN: open for writing; EACCES: not the owner; EINVAL: no leases
            return os.strerror(exc.errno or 0)
        self.taken = True
        return ""

    def held(self) -> bool:
        """True while the lease holds and nobody waits to write or truncate; on the first False
        the lease is let go (the waiting process goes on)."""
        if not self.taken:
            return False
        try:
            if fcntl.fcntl(self.fd, F_GETLEASE) == fcntl.F_RDLCK:
                return True
        except OSError:  # pragma: no cover - the descriptor went away
            pass
        self.release()
        return False

    def release(self) -> None:
        if self.taken:
            self.taken = False
            try:
                fcntl.fcntl(self.fd, F_SETLEASE, fcntl.F_UNLCK)
            except OSError:  # pragma: no cover - already broken and removed
                pass
