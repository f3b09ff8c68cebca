"""Open files that a hostile or careless host may have put in a watched tree, without blocking.

``open(path)`` on a FIFO blocks until a writer appears (forever, in a dump tree), a device may
block or have side effects, and a socket cannot be opened at all. Every dump, compare and log
read therefore opens through :func:`open_regular`: the path is opened with ``O_NONBLOCK`` (a
FIFO opens at once then), the *open descriptor* is checked with ``fstat`` to be a regular file
(no race between a check and the open), and only then is ``O_NONBLOCK`` cleared. Anything else
raises :class:`NotRegularFile`, an ``OSError`` whose message names what the path is.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from typing import IO, Any, Callable

from .kernels.lazy import np   # numpy on first use (kernels/lazy.py)

__all__ = ["FileTooBig", "NotRegularFile", "file_kind", "mapped_pages", "memmap_regular", "open_regular",
           "open_regular_file", "read_regular"]


class NotRegularFile(OSError):
    """The path is a FIFO, device, socket or directory: refused, never read."""


class FileTooBig(ValueError):
    """A whole-file read (:func:`read_regular`) over its limit; the message says how big."""


def file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def open_regular(path: str | os.PathLike, flags: int = 0) -> int:
    """A read-only descriptor of the regular file ``path`` (blocking mode, close-on-exec).

    ``flags`` are added to ``O_RDONLY`` (e.g. ``O_NOATIME``). Raises :class:`NotRegularFile`
    for anything that is not a regular file, ``OSError`` when the open fails."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | flags)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket (or a FIFO-like device without a peer)
            raise NotRegularFile(errno.ENXIO, "not a regular file (a socket or device); refused", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"not a regular file ({file_kind(st.st_mode)}); refused", path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_file(path: str | os.PathLike, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """:func:`open_regular` as a file object (``mode`` "rb" or "r" with ``encoding`` etc.)."""
    if any(c in mode for c in "wax+"):
        raise ValueError(f"open_regular_file reads only, not mode {mode!r}")
    fd = open_regular(path)
    try:
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The whole regular file ``path``, refused (:class:`FileTooBig`) when it is or grows over
    ``max_bytes`` while read; :class:`NotRegularFile` / ``OSError`` as :func:`open_regular`."""
    with open_regular_file(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise FileTooBig(f"too big: {size} bytes (limit {max_bytes})")
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise FileTooBig(f"too big: over {max_bytes} bytes")
    return raw


def memmap_regular(path: str | os.PathLike, dtype: Any, offset: int, count: int) -> np.memmap:
    """A read-only memory map of ``count`` elements at ``offset`` of a regular file."""
    with open_regular_file(path) as fh:
        return np.memmap(fh, dtype=dtype, mode="r", offset=offset, shape=(count,))


def mapped_pages(a: np.ndarray) -> "Callable[[int, int], None] | None":
    """For a contiguous view into a file memory map (``np.memmap`` or a view of one): a function
    ``release(start, end)`` that drops the whole pages of bytes ``start..end`` of ``a`` from the
    process's RSS (``madvise(MADV_DONTNEED)``; they stay in the page cache and fault back in if
    read again). None for anything else."""
    if not hasattr(mmap, "MADV_DONTNEED") or not a.flags.c_contiguous:
        return None
    b: Any = a
    mm = None
    while b is not None and mm is None:
        mm = getattr(b, "_mmap", None)
        b = getattr(b, "base", None)
    if not isinstance(mm, mmap.mmap):
        return None
    try:
        base = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data
    except (ValueError, TypeError, BufferError):  # closed or empty map
        return None
    delta = a.ctypes.data - base
    size = len(mm)

    def release(start: int, end: int) -> None:
        lo = -(-(delta + start) // mmap.PAGESIZE) * mmap.PAGESIZE   # whole pages inside only
        hi = min(size, (delta + end) // mmap.PAGESIZE * mmap.PAGESIZE)
        if hi > lo:
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):  # pragma: no cover - advisory only
                pass
    return release
