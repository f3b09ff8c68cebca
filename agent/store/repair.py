"""Damaged rows of a valid state database, and reading the state while it cannot be written.

A row that does not decode, or decodes to something impossible (a negative offset, an alert
time that is not a number), is *quarantined*: copied into the ``quarantine`` table (table name,
the row as JSON, the reason, when) and deleted from its table in the next commit, counted in
``precision_agent_state_rows_quarantined_total{table}`` and named in one ``state`` error per
table. It is never used and never read again, so a bad row is counted once, not at every start.

Where a damaged ``offsets`` row leaves its file (the safe point), chosen so that no incident is
lost and none is paged twice:

- the file is still the generation the row names (device and inode) and one of offset and line
  count is sound: the other is computed from the file (the offset after that many newlines, or
  the newlines before that offset), and reading resumes exactly where it stopped;
- otherwise the file is read again from its start: a lost incident is worse than a repeated
  one, and an alert still active is not paged again (the alert book has it; only an incident
  that already resolved can page a second time). Reading from the end instead would silently
  skip whatever the run wrote while the agent was down.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterable

from ..readers.tailer import TailPosition

QUARANTINE_SCHEMA = """CREATE TABLE IF NOT EXISTS quarantine (
    tbl TEXT NOT NULL, row TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL);"""
QUARANTINE_COLUMNS = ("tbl", "row", "reason", "at")
# the primary key of each table, by column position in the rows the store reads
KEYS = {"offsets": ("path",), "scanned": ("path",), "alerts": ("fingerprint",), "series": ("labels",),
        "memory": ("rule", "slot", "key")}
CHUNK = 1 << 20


def _count(v: Any) -> int | None:
    """``v`` as a non-negative integer, or None (a bool, a float, text or a negative number)."""
    return v if type(v) is int and v >= 0 else None


def check_position(row: tuple[Any, ...]) -> str | None:
    """Why an ``offsets`` row (path, dev, ino, offset, line) is impossible, or None if it is sound."""
    path, dev, ino, offset, line = row
    if type(path) is not str or not path:
        return f"path {path!r} is not a file name"
    if _count(dev) is None or _count(ino) is None:
        return f"device/inode {dev!r}/{ino!r} are not numbers >= 0"
    if _count(offset) is None or _count(line) is None:
        return f"offset {offset!r} or line count {line!r} is not a number >= 0"
    if offset < line or (offset == 0) != (line == 0):  # every line ends with its own newline byte
        return f"offset {offset} does not fit line count {line}"
    return None


def safe_position(row: tuple[Any, ...]) -> tuple[TailPosition | None, str]:
    """Where to read the file of a damaged ``offsets`` row from, and why (see the module doc).
    None: nothing is known of the file (it is taken as a new file)."""
    path, dev, ino, offset, line = row
    if type(path) is not str or not path or _count(dev) is None or _count(ino) is None:
        return None, "its file is not known: it is read as a new file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return TailPosition(dev, ino, 0, 0), "its file is not there: a file at that path is read from its start"
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino):
            return TailPosition(dev, ino, 0, 0), "its file was replaced: the new file is read from its start"
        if _count(line) is not None:
            found = _after_lines(fd, line, st.st_size)
            if found is not None:
                return TailPosition(dev, ino, found, line), f"resuming after line {line} (byte {found})"
        if _count(offset) is not None and 0 < offset <= st.st_size and os.pread(fd, 1, offset - 1) == b"\n":
            return (TailPosition(dev, ino, offset, _lines_before(fd, offset)),
                    f"resuming at byte {offset} (a line start)")
        return TailPosition(dev, ino, 0, 0), "the file is read again from its start"
    except OSError:
        return TailPosition(dev, ino, 0, 0), "the file is read again from its start"
    finally:
        os.close(fd)


def _after_lines(fd: int, n: int, size: int) -> int | None:
    """The offset just after the ``n``-th newline of the file (0 for n == 0), None if it has fewer."""
    if n == 0:
        return 0
    pos = 0
    while pos < size and (data := os.pread(fd, min(CHUNK, size - pos), pos)):
        k = data.count(b"\n")
        if k >= n:
            i = -1
            for _ in range(n):
                i = data.index(b"\n", i + 1)
            return pos + i + 1
        n -= k
        pos += len(data)
    return None


def _lines_before(fd: int, offset: int) -> int:
    pos = count = 0
    while pos < offset and (data := os.pread(fd, min(CHUNK, offset - pos), pos)):
        count += data.count(b"\n")
        pos += len(data)
    return count


def row_json(row: tuple[Any, ...]) -> str:
    return json.dumps([v if isinstance(v, (int, float, str, type(None))) else repr(v) for v in row],
                      default=repr)[:100_000]


def write_quarantine(db: sqlite3.Connection, rows: Iterable[tuple[str, tuple[Any, ...], str]], now: float) -> None:
    """Copy damaged rows to the quarantine table and delete them from their own (by primary key),
    in the caller's transaction: before that batch's own writes, which may replace them."""
    for table, row, reason in rows:
        db.execute("INSERT INTO quarantine VALUES (?,?,?,?)", (table, row_json(row), reason, now))
        key = KEYS[table]
        db.execute(f"DELETE FROM {table} WHERE " + " AND ".join(f"{k}=?" for k in key), row[:len(key)])


def open_read_only(path: Path, tables: Iterable[str]) -> sqlite3.Connection | None:
    """The state on disk, read-only, for a start while the store cannot be written (disk full):
    the agent resumes where it was instead of reading every log again. ``mode=ro`` sees the
    write-ahead log; where that needs a file it cannot create, ``immutable=1`` reads the main
    file alone (what the last checkpoint holds). None when nothing is readable."""
    if not path.is_file():
        return None
    for query in ("mode=ro", "immutable=1"):
        db = None
        try:
            db = sqlite3.connect(f"file:{path}?{query}", uri=True, timeout=5.0, check_same_thread=False)
            found = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if set(tables) <= found:
                return db
            db.close()
            return None
        except sqlite3.Error:
            if db is not None:
                db.close()
    return None
