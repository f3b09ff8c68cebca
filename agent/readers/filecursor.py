"""What every structured metric-file reader (TensorBoard event files, CSV metric logs) shares:
following one file's bytes by ``(st_dev, st_ino)`` with a committed offset (``FileCursor``), and
the stream half the daemon and ``replay`` drive exactly like a text ``LogStream``
(``MetricFileStream``: ``poll``, ``finish``, ``position``, ``stats``, ``tailer``, ``parser.errors``).

The text tailer is line-oriented; these files are not, so the cursor reads raw bytes and leaves
framing to each reader: a reader consumes only whole records and the offset stays at the start
of a partial one (a file being written ends in one), so a restart from the committed position
neither loses nor repeats a record. The cursor keeps the text tailer's other promises: regular
files only (``safeio``), the symlink confinement check on every descriptor, never an exception
out of a read (I/O problems become ``TailEvent``s), a descriptor the daemon may close to bound open
files (the next read reopens it and checks the inode), and a replaced or shrunk file read from 0.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from ..model import Labels, Sample, SourcePos, make_labels
from ..safeio import open_regular
from .logstream import StreamStats
from .tailer import TailEvent, TailPosition


class FileCursor:
    """Raw bytes of one followed file from a committed offset; see the module docstring."""

    __slots__ = ("path", "_pending", "_fd", "_gen", "offset", "line", "seen", "_events", "_last_error", "_check",
                 "_missing")

    def __init__(self, path: str, position: TailPosition | None = None,
                 check_open: Callable[[str, int], None] | None = None) -> None:
        self.path = path
        self._pending = position
        self._fd: int | None = None
        self._gen: tuple[int, int] | None = None
        self.offset = 0      # committed: the start of the first record not yet handed out
        self.line = 0        # records (CSV: lines) handed out in this generation
        self.seen = 0        # bytes looked at (a torn record's start is past ``offset``, not unread)
        self._events: list[tuple[TailEvent, str]] = []
        self._last_error: str | None = None
        self._check = check_open
        self._missing = False

    @property
    def position(self) -> TailPosition | None:
        if self._gen is None:
            return self._pending
        return TailPosition(self._gen[0], self._gen[1], self.offset, self.line)

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    @property
    def missing(self) -> bool:
        """The path did not exist at the last open."""
        return self._missing

    def drain_events(self) -> list[tuple[TailEvent, str]]:
        events, self._events = self._events, []
        return events

    def event(self, kind: TailEvent, message: str) -> None:
        self._events.append((kind, message))

    def error(self, exc: OSError | str) -> None:
        """One ERROR event per distinct message (a polling loop must not spam)."""
        if getattr(exc, "reported", False):
            return  # the confinement check refused the file and said so itself
        msg = f"{self.path}: {exc}"
        if msg != self._last_error:
            self._events.append((TailEvent.ERROR, msg))
            self._last_error = msg

    def close(self) -> None:
        """Release the descriptor; the next ``size`` reopens at the same position."""
        self._pending = self.position
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._gen = None, None

    @property
    def consumed_bytes(self) -> int:
        """Bytes of this generation looked at so far: the follower's measure of progress in a turn
        (the text tailer's counter of the same name)."""
        return max(self.offset, self.seen)

    def unread_bytes(self) -> int:
        if self._fd is None:
            return 0
        try:
            return max(os.fstat(self._fd).st_size - max(self.offset, self.seen), 0)
        except OSError:
            return 0

    def restart(self, message: str, kind: TailEvent = TailEvent.TRUNCATED) -> None:
        """Read this generation again from 0 (it shrank: a new run's file under the same name)."""
        self.offset = self.line = self.seen = 0
        self.event(kind, f"{self.path}: {message}")

    def size(self, restart_on_shrink: bool = True) -> int | None:
        """The open generation's size (a file that shrank below the offset is read from 0 unless
        ``restart_on_shrink`` is false); None when nothing can be read."""
        try:
            if self._fd is None and not self._open():
                return None
            assert self._fd is not None
            st = os.fstat(self._fd)
            if restart_on_shrink and st.st_size < self.offset:
                self.restart(f"shrank below byte {self.offset}; reading from 0")
            self._last_error = None
            return st.st_size
        except OSError as exc:
            self.error(exc)
            return None

    def replaced(self) -> bool:
        """Whether the path now names another file (the caller has read this one to its end):
        if so, the cursor switches to it from 0."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False  # gone: the writer may still append to the unlinked file
        if self._gen is None or (st.st_dev, st.st_ino) == self._gen or st.st_size == 0:
            return False
        self.close()
        self._pending = None
        self.event(TailEvent.ROTATED, f"{self.path}: replaced by a new file; following it from 0")
        try:
            return self._open()
        except OSError as exc:  # (NotRegularFile is one: a directory now under the name)
            self.error(exc)
            return False

    def pread(self, n: int, at: int) -> bytes:
        """Up to ``n`` bytes at ``at``; an I/O error (EIO, ...) is said once and reads as nothing
        (never an exception out of a poll): the readers then wait as at a torn record."""
        if self._fd is None:
            return b""
        try:
            return os.pread(self._fd, n, at)
        except OSError as exc:
            self.error(exc)
            return b""

    def _open(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if not self._missing:
                self._missing = True
                self.event(TailEvent.MISSING, f"{self.path} does not exist")
            return False
        self._missing = False
        fd = open_regular(self.path)
        try:
            if self._check is not None:
                self._check(self.path, fd)
            fst = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        gen = (fst.st_dev, fst.st_ino)
        pos, self._pending = self._pending, None
        self._fd, self._gen = fd, gen
        self.offset = self.line = self.seen = 0
        if pos is not None and (pos.dev, pos.ino) == gen:
            if fst.st_size >= pos.offset:
                self.offset, self.line = pos.offset, pos.line
            else:
                self.event(TailEvent.TRUNCATED, f"{self.path} shrank to {fst.st_size} < saved offset "
                           f"{pos.offset}; reading from 0")
        elif pos is not None:
            self.event(TailEvent.ROTATED, f"saved generation of {self.path} not found; following the "
                       "new file from 0")
        return True


class StreamErrors:
    """The ``parser`` a follower asks for errors (``parser.errors``, one line per cause and file)."""

    __slots__ = ("errors", "format", "_said")
    sparse = False  # a metric file's records are its whole content: one without any is blind (yields.py)

    def __init__(self, fmt: str) -> None:
        self.errors: list[str] = []
        self.format = fmt
        self._said: set[str] = set()

    def once(self, cause: str, message: str) -> None:
        if cause not in self._said:
            self._said.add(cause)
            self.errors.append(message)


UNMAPPED_KEPT = 32  # tag or column names kept to say what a file holds when none is mapped


class MetricFileStream:
    """The common half of a structured reader: labels, counts, samples; subclasses read records
    (``_read(budget, final) -> list[Sample]``) and note the names the metric map does not know in
    ``unmapped``."""

    FORMAT = ""
    NAMES = "names"  # what the reader's names are called (tags, columns)

    def __init__(self, path: str, labels: Mapping[str, str] | None = None, position: TailPosition | None = None,
                 *, check_open: Callable[[str, int], None] | None = None, max_record_bytes: int = 1 << 20,
                 start_at_end: bool = False) -> None:
        self.path = path
        # a watch's ``start_at_end`` with no saved position: the records already there are skipped
        # (``_skip_existing``, at the first read that sees a whole record)
        self.at_end = start_at_end and position is None
        self._held: int | None = None  # (the size the file had when first seen)
        self.base_labels: Labels = make_labels(labels)
        self.tailer = FileCursor(path, position, check_open)
        self.parser = StreamErrors(self.FORMAT)
        self.stats = StreamStats()
        self.max_record = max_record_bytes
        self.unmapped: dict[str, None] = {}
        self.mapped_names: list[str] = []  # (CSV: the header's mapped columns)

    @property
    def format(self) -> str:
        return self.FORMAT

    @property
    def position(self) -> TailPosition | None:
        return self.tailer.position

    @property
    def is_open(self) -> bool:
        return self.tailer.is_open

    def poll(self, budget_bytes: int = 16 << 20, now: float | None = None) -> list[Sample]:
        return self._read(budget_bytes, now, final=False)

    def finish(self, now: float | None = None) -> list[Sample]:
        """At the end of a finished file: whatever is left (a torn last record is said, not read)."""
        out: list[Sample] = []
        while True:
            before = self.tailer.offset, self.stats.bytes
            out += self._read(1 << 30, now, final=True)
            if (self.tailer.offset, self.stats.bytes) == before:
                return out

    def close(self) -> None:
        self.tailer.close()

    def existing(self, size: int | None) -> int | None:
        """``start_at_end``: the bytes the file held when the reader first saw it (what is skipped),
        None when nothing is to be skipped: a file that did not exist then, or that was empty, is
        read in full like a text log."""
        if not self.at_end:
            return None
        if size is None:
            self.at_end = not self.tailer.missing
            return None
        if self._held is None:
            self._held = size
        return self._held

    def sample_lines(self) -> list[str]:
        """What the file holds when no record of it was read (replay's and the follower's
        "unrecognized" evidence): the tag or column names seen that the metric map does not name."""
        if self.mapped_names:  # (a CSV header with a mapped column but no value yet)
            return [f"{self.NAMES}: {', '.join(self.mapped_names)} mapped, but no value read yet"]
        if not self.unmapped:
            return []
        names = ", ".join(list(self.unmapped)[:UNMAPPED_KEPT])
        more = ", ..." if len(self.unmapped) >= UNMAPPED_KEPT else ""
        return [f"{self.NAMES}: {names}{more} (none is mapped: extend PRECISION_AGENT_METRIC_MAP, "
                "docs/metric-files.md)"]

    def skipped(self, cause: str, message: str, n: int = 1) -> None:
        """A record (or ``n``) not read: counted, and said once per cause."""
        self.stats.skipped += n
        self.parser.once(cause, f"{self.path}: {message} (later ones of this kind are counted, not logged)")

    def sample(self, metric: str, value: float, step: int | None, line: int, offset: int, t: float,
               log_time: float | None) -> Sample:
        return Sample(self.base_labels, metric, value, step, SourcePos(self.path, line, offset), t, log_time,
                      (), self.FORMAT)

    def _read(self, budget: int, now: float | None, final: bool) -> list[Sample]:
        raise NotImplementedError
