"""Follow a growing training log file without losing or double-reading a line.

Training jobs write logs for days; the agent may restart, logrotate may rename or copytruncate the
file, and tqdm may write megabyte-long ``\\r``-separated "lines". The tailer therefore:

* follows a file *generation* by ``(st_dev, st_ino)``, not by name, keeping the fd open so a
  renamed-away generation can be drained to its end before switching;
* hands out complete ``\\n``-terminated lines only and keeps the partial tail unconsumed, so the
  persisted :class:`TailPosition` always sits on a line start and a restart from it yields
  exactly-once delivery;
* bounds memory for over-long lines by keeping only their first ``max_line_bytes`` (the rest is
  read once and discarded, never stored, even across a closed and reopened descriptor);
* never raises out of :meth:`LogTailer.read`: I/O problems become events.

Known limits (inherent to polling by size): a copytruncate after which the writer refills the file
past our read position before the next ``read()`` is not detected, lines still unread when a file
is truncated are gone, and a saved position whose inode was freed and reused by a new file of at
least that size is taken at its word.
"""

from __future__ import annotations

import os
from typing import Callable

from ..safeio import open_regular
from .tailtypes import TailEvent, TailPosition, TextBlock

__all__ = ["LogTailer", "TailEvent", "TailPosition", "TextBlock"]
_NO_BUF = b""  # the buffer of a tailer without a descriptor (see close)
_DEVS: dict[int, int] = {}  # one st_dev object for every file of a file system (10,000 positions hold it)


def _decode(raw: bytes) -> str:
    """Normalise ``\\n``-joined raw lines: drop NULs, strip one CR before each LF. Decoding the
    joined block is equivalent to decoding line by line because the UTF-8 decoder never folds an
    ASCII ``\\n`` into a replacement sequence."""
    raw = raw.replace(b"\0", b"")
    if b"\r" in raw:  # a one-byte search is a fast memchr; the two-byte replace is not
        raw = raw.replace(b"\r\n", b"\n")
    return raw.decode("utf-8", "replace")


class LogTailer:
    """Incrementally read complete lines of ``path``; see the module docstring."""

    __slots__ = ("path", "_max", "_chunk", "_pending", "_start_at_end", "_fd", "_gen", "_offset", "_line",
                 "_read_pos", "_buf", "_discarding", "_events", "_missing_reported", "_last_error", "_check",
                 "_skip", "consumed_bytes")

    def __init__(
        self,
        path: str,
        position: TailPosition | None = None,
        *,
        start_at_end: bool = False,
        max_line_bytes: int = 1 << 20,
        chunk_bytes: int = 1 << 20,
        check_open: Callable[[str, int], None] | None = None,
        lazy: bool = False,
    ) -> None:
        """``check_open(path, fd)``: called on every descriptor opened; raises an OSError to
        refuse the file (the daemon's symlink confinement: it reports the refusal itself).
        ``lazy``: open the file at the first ``read``, not now (as after ``close``)."""
        if max_line_bytes < 1 or chunk_bytes < 1:
            raise ValueError("max_line_bytes and chunk_bytes must be positive")
        self.path = os.fspath(path)
        self._max, self._chunk = max_line_bytes, chunk_bytes
        self._pending = position  # where to start once the file can be opened
        self._start_at_end = start_at_end
        self._fd: int | None = None
        self._gen: tuple[int, int] | None = None  # (dev, ino) of the open generation
        self._offset, self._line = 0, 0  # start of the pending (incomplete) line, lines before it
        self._read_pos = 0  # file offset up to which bytes have been read
        self._buf: bytearray | bytes = _NO_BUF  # head of the pending line (max_line_bytes at most) while open
        self._discarding = False  # pending line exceeded max_line_bytes
        self._events: list[tuple[TailEvent, str]] | None = None  # made at the first event (most files have none)
        self._missing_reported = False
        self._last_error: str | None = None
        self._check = check_open
        self._skip: tuple[tuple[int, int], int, int, bool] | None = None  # a partial line at close()
        self.consumed_bytes = 0  # bytes read by this object, as lines or as the cut part of a line: progress
        if lazy:
            return
        try:
            self._start()
        except OSError as exc:
            self._error(exc)

    def at_rest(self) -> TailPosition | None:
        """The position alone, when it is all this tailer holds (closed, no event, error, cut
        line or start-at-end pending): ``LogTailer(path, it, lazy=True)`` is the same tailer."""
        if self._fd is not None or self._pending is None or self._skip is not None or self._events \
                or self._last_error is not None or self._missing_reported or self._start_at_end:
            return None
        return self._pending

    @property
    def position(self) -> TailPosition | None:
        """Exactly what was handed out so far; None before any file was seen."""
        if self._gen is None:
            return self._pending
        return TailPosition(self._gen[0], self._gen[1], self._offset, self._line)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the incomplete line held in memory (bounded by max_line_bytes)."""
        return len(self._buf)

    def read(self, budget_bytes: int = 8 << 20) -> list[TextBlock]:
        """Return new complete lines, reading at most about ``budget_bytes``. An empty list means
        nothing new could be delivered now (perhaps the budget went into discarding an over-long
        line: see ``consumed_bytes``, ``unread_bytes``); just call again later."""
        out: list[TextBlock] = []
        try:
            self._read(out, budget_bytes)
            self._last_error = None
        except OSError as exc:  # blocks already in `out` were consumed: keep them
            self._error(exc)
        return out

    def flush_partial(self) -> TextBlock | None:
        """Hand out the pending unterminated line as complete, e.g. at the end of a finished file
        in one-shot replay. Reads on to EOF first (stopping at a newline if one arrived), so an
        over-long tail is skipped, not re-emitted."""
        if self._fd is None:
            return None
        try:
            while data := os.pread(self._fd, self._chunk, self._read_pos):
                nl = data.find(b"\n")
                if nl >= 0:
                    return self._consume(data[: nl + 1])
                self._consume(data)
        except OSError as exc:
            self._error(exc)
        return self._take_partial()

    def drain_events(self) -> list[tuple[TailEvent, str]]:
        """Events since the last call, each with a human-readable message."""
        events, self._events = self._events or [], None
        return events

    def unread_bytes(self) -> int:
        """Bytes the open generation holds past what was read; 0 without a descriptor. For a
        deleted file, what is still there to read through the descriptor before dropping it."""
        if self._fd is None:
            return 0
        try:
            return max(os.fstat(self._fd).st_size - self._read_pos, 0)
        except OSError:
            return 0

    @property
    def is_open(self) -> bool:
        """Whether a file descriptor is held (the daemon bounds how many are)."""
        return self._fd is not None

    def close(self) -> None:
        """Release the fd; a later read() reopens from the current position (see _resume_skip)."""
        self._pending = self.position
        self._skip = (self._gen, self._offset, self._read_pos, self._discarding) \
            if self._gen is not None and self._read_pos > self._offset else None
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._gen = None, None
        self._buf = _NO_BUF  # a closed (idle) file holds no buffer: 10,000 of them may be followed
        self._discarding = False

    def __enter__(self) -> LogTailer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _event(self, kind: TailEvent, msg: str) -> None:
        self._events = [*(self._events or ()), (kind, msg)]  # rare: a copy costs nothing

    def _error(self, exc: OSError) -> None:
        """Record an error once per distinct message so a polling loop does not spam."""
        if getattr(exc, "reported", False):
            return  # check_open refused the file and said so itself
        msg = f"{self.path}: {exc}"
        if msg != self._last_error:
            self._event(TailEvent.ERROR, msg)
            self._last_error = msg

    def _open(self, path: str) -> int:
        # regular files only, checked on the open descriptor: a FIFO or device never blocks us
        noatime = getattr(os, "O_NOATIME", 0)
        if noatime:
            try:  # avoids atime writes, but only permitted to the file's owner
                return open_regular(path, noatime)
            except PermissionError:
                pass
        return open_regular(path)

    def _open_checked(self, path: str) -> int:
        fd = self._open(path)
        if self._check is not None:
            try:
                self._check(path, fd)
            except OSError:
                os.close(fd)
                raise
        return fd

    def _stat_path(self) -> os.stat_result | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if not self._missing_reported:
                self._event(TailEvent.MISSING, f"{self.path} does not exist")
                self._missing_reported = True
            return None
        self._missing_reported = False
        return st

    def _adopt(self, fd: int, gen: tuple[int, int], offset: int, line: int) -> None:
        self._fd, self._gen = fd, gen
        self._offset = self._read_pos = offset
        self._line = line
        self._buf = bytearray()
        self._discarding = False
        self._pending, self._start_at_end = None, False

    def _find_generation(self, dev: int, ino: int) -> str | None:
        """A renamed-away copy of the saved generation (e.g. train.log.1), if any."""
        try:
            with os.scandir(os.path.dirname(self.path) or ".") as it:
                for entry in it:
                    if entry.inode() == ino and entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        if (st.st_dev, st.st_ino) == (dev, ino):
                            return entry.path
        except OSError:
            pass
        return None

    def _start(self) -> bool:
        """Open the first generation, honouring a saved position; False if absent."""
        pos = self._pending
        st = self._stat_path()
        if pos is not None and (st is None or (st.st_dev, st.st_ino) != (pos.dev, pos.ino)):
            old = self._find_generation(pos.dev, pos.ino)
            if old is not None:
                fd = self._open_checked(old)
                fst = os.fstat(fd)
                if (fst.st_dev, fst.st_ino) == (pos.dev, pos.ino) and fst.st_size >= pos.offset:
                    self._adopt(fd, (pos.dev, pos.ino), pos.offset, pos.line)
                    self._resume_skip(fst.st_size)
                    msg = f"resuming {old} at byte {pos.offset} before following {self.path}"
                    self._event(TailEvent.RESUMED_FROM_ROTATED, msg)
                    return True
                os.close(fd)
        if st is None:
            self._start_at_end = False  # a file that appears later is read in full
            return False
        fd = self._open_checked(self.path)
        try:
            fst = os.fstat(fd)
            gen = (_DEVS.setdefault(fst.st_dev, fst.st_dev) if len(_DEVS) < 64 else fst.st_dev, fst.st_ino)
            offset = line = 0
            if pos is not None and gen == (pos.dev, pos.ino):
                if fst.st_size >= pos.offset:
                    offset, line = pos.offset, pos.line
                else:
                    msg = f"{self.path} shrank to {fst.st_size} < saved offset {pos.offset}"
                    self._event(TailEvent.TRUNCATED, msg + "; reading from 0")
            elif pos is not None:
                msg = f"saved generation of {self.path} not found; its unread lines are lost"
                self._event(TailEvent.ROTATED, msg + ", following the new file from 0")
            elif self._start_at_end:
                offset, line = self._scan_complete_lines(fd, fst.st_size)
        except OSError:
            os.close(fd)
            raise
        self._adopt(fd, gen, offset, line)
        self._resume_skip(fst.st_size)
        return True

    def _resume_skip(self, size: int) -> None:
        """Back on a generation closed inside a line: take its head again (max_line_bytes at most,
        outside the budget) and go on where the reading stopped, so a line longer than a budget
        (or over-long, and skipped) still gets past, and is read once, when closed every turn."""
        skip, self._skip = self._skip, None
        if skip is None or skip[0] != self._gen or skip[1] != self._offset or size < skip[2] or self._fd is None:
            return
        self._buf += os.pread(self._fd, min(self._max, skip[2] - skip[1]), self._offset)
        self._read_pos, self._discarding = skip[2], skip[3]

    def _scan_complete_lines(self, fd: int, size: int) -> tuple[int, int]:
        """(offset after the last newline, newline count) so numbering stays true."""
        end = count = pos = 0
        while pos < size and (data := os.pread(fd, min(self._chunk, size - pos), pos)):
            if n := data.count(b"\n"):
                count += n
                end = pos + data.rfind(b"\n") + 1
            pos += len(data)
        return end, count

    def _read(self, out: list[TextBlock], budget: int) -> None:
        if self._fd is None and not self._start():
            return
        while True:
            assert self._fd is not None and self._gen is not None
            st = self._stat_path()
            same = st is not None and (st.st_dev, st.st_ino) == self._gen
            if same and os.fstat(self._fd).st_size < self._read_pos:
                msg = f"{self.path} shrank below byte {self._read_pos}; reading from 0"
                self._event(TailEvent.TRUNCATED, msg)
                self._adopt(self._fd, self._gen, 0, 0)
            budget = self._pump(out, budget)
            # Stay on the open generation while it is still the path, while the
            # budget is spent (not known to be at EOF), while the path is missing
            # (the writer may still append to the unlinked file) and while the
            # replacement is empty (the writer has not moved on yet: switching now
            # could miss its last lines and cut its unterminated last line).
            if same or budget <= 0 or st is None or st.st_size == 0:
                return
            if (block := self._take_partial()) is not None:
                out.append(block)
            old, fd = self._gen, self._fd
            self._fd, self._gen = None, None
            self._pending = None
            os.close(fd)
            self._event(TailEvent.ROTATED, f"{self.path}: {old} drained, following new file")
            if not self._start():  # pending is None: new generation from offset 0
                return

    def _pump(self, out: list[TextBlock], budget: int) -> int:
        """Read chunks until EOF or the budget is spent; return the budget left."""
        assert self._fd is not None
        while budget > 0:
            data = os.pread(self._fd, min(self._chunk, budget), self._read_pos)
            if not data:
                return budget
            budget -= len(data)
            if (block := self._consume(data)) is not None:
                out.append(block)
        return 0

    def _hold(self, rest: bytes) -> None:
        room = self._max - len(self._buf)
        if len(rest) > room:
            self._buf += rest[: max(room, 0)]
            self._discarding = True
        else:
            self._buf += rest

    def _consume(self, data: bytes) -> TextBlock | None:
        """Turn freshly read bytes (at _read_pos) into a block of complete lines."""
        base = self._read_pos
        self._read_pos += len(data)
        self.consumed_bytes += len(data)
        last = data.rfind(b"\n")
        if last < 0:
            self._hold(data)
            return None
        if not self._discarding:
            # the common case: no line can be over-long (the held head plus the chunk's first line
            # fits, and every later line is shorter than the stretch between the first and last
            # newline), so the lines go out as read, without a split and join
            first = data.find(b"\n")
            if len(self._buf) + first <= self._max and last - first <= self._max:
                raw = bytes(self._buf) + data[: last + 1] if self._buf else data[: last + 1]
                block = self._emit(raw, data.count(b"\n", 0, last) + 1, base + last + 1, 0)
                self._hold(data[last + 1 :])
                return block
        parts = data[:last].split(b"\n")
        cut_first = self._discarding or len(self._buf) + len(parts[0]) > self._max
        if self._buf:
            parts[0] = bytes(self._buf) + parts[0][: self._max - len(self._buf)]
        truncated = 0
        if cut_first or max(map(len, parts)) > self._max:
            for i, part in enumerate(parts):
                if len(part) > self._max or (i == 0 and cut_first):
                    parts[i] = part[: self._max]
                    truncated += 1
        block = self._emit(b"\n".join(parts) + b"\n", len(parts), base + last + 1, truncated)
        self._hold(data[last + 1 :])
        return block

    def _take_partial(self) -> TextBlock | None:
        """Consume the pending unterminated line as a complete one."""
        if self._gen is None or self._read_pos == self._offset:
            return None
        return self._emit(bytes(self._buf) + b"\n", 1, self._read_pos, int(self._discarding))

    def _emit(self, raw: bytes, n_lines: int, end: int, truncated: int) -> TextBlock:
        """Hand out ``n_lines`` raw lines ending at byte ``end`` and advance past them."""
        assert self._gen is not None
        line, gen = self._line + 1, self._gen
        block = TextBlock(self.path, _decode(raw), line, n_lines, self._offset, end, gen, truncated)
        self._offset, self._line = end, self._line + n_lines
        self._buf.clear()
        self._discarding = False
        return block
