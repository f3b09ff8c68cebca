"""The state store: one SQLite file (stdlib, WAL) holding everything a restart must not lose.

Tailer offsets, the scanned-file index, alert states, series summaries and the detectors' memory
(agent/store/memory.py) are written in one transaction per processing batch, *after* the batch's samples went through the pipeline, so
a restart resumes exactly where the last committed batch ended and does not re-page alerts.

Schema changes are additive: tables are created when missing (``CREATE TABLE IF NOT EXISTS``), so a
store written by an older agent gains the new ones (``memory`` came later) and keeps its rows; the
column check at open tells a foreign file from ours.

A damaged file (not SQLite, failing ``PRAGMA quick_check``, foreign tables) is moved aside to
``state.sqlite3.corrupt-<UTC time>`` (the newest three are kept), reported as a ``state`` error,
and replaced by an empty store: an always-on agent that re-reads its logs once is better than
one that does not start. A state directory that cannot be written still stops the start (exit 2),
unless the cause is transient (disk full, quota, I/O error: causes.py): then the agent starts
from what it can read of the store, alerts from memory and retries the save with a backoff.
A damaged *row* of a sound file is quarantined (repair.py).
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

from ..config import ConfigError
from ..model import Alert, AlertState, Labels
from ..readers.tailer import TailPosition
from ..series.state import SeriesState
from .causes import TRANSIENT_CAUSES, StateError, cause_of, state_error
from .repair import (QUARANTINE_COLUMNS, QUARANTINE_SCHEMA, check_position, open_read_only, safe_position,
                     write_quarantine)

if TYPE_CHECKING:
    from .book import MemoryDelta

SCHEMA_VERSION = 1
T = TypeVar("T")
DB_NAME = "state.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS offsets (
    path TEXT PRIMARY KEY, dev INTEGER NOT NULL, ino INTEGER NOT NULL,
    offset INTEGER NOT NULL, line INTEGER NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS scanned (
    path TEXT PRIMARY KEY, dev INTEGER NOT NULL, ino INTEGER NOT NULL, size INTEGER NOT NULL,
    mtime REAL NOT NULL, status TEXT NOT NULL, scanned_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS alerts (
    fingerprint TEXT PRIMARY KEY, rule TEXT NOT NULL, labels TEXT NOT NULL, state TEXT NOT NULL,
    active_at REAL NOT NULL, last_seen REAL NOT NULL, fired_at REAL, resolved_at REAL,
    annotations TEXT NOT NULL, finding TEXT NOT NULL, count INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS series (labels TEXT PRIMARY KEY, data TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS memory (
    rule TEXT NOT NULL, slot TEXT NOT NULL, key TEXT NOT NULL, digest TEXT NOT NULL, data TEXT NOT NULL,
    seq INTEGER NOT NULL, PRIMARY KEY (rule, slot, key));
""" + QUARANTINE_SCHEMA


KEEP_CORRUPT = 3  # moved-aside databases kept for a post-mortem; older ones are deleted
_TABLES = {  # table -> columns, checked at open: a foreign SQLite file is as unusable as garbage
    "meta": ("key", "value"),
    "offsets": ("path", "dev", "ino", "offset", "line", "updated"),
    "scanned": ("path", "dev", "ino", "size", "mtime", "status", "scanned_at"),
    "alerts": ("fingerprint", "rule", "labels", "state", "active_at", "last_seen", "fired_at", "resolved_at",
               "annotations", "finding", "count"),
    "series": ("labels", "data", "updated"),
    "memory": ("rule", "slot", "key", "digest", "data", "seq"),
    "quarantine": QUARANTINE_COLUMNS,
}
# sqlite result codes that say "a human must fix the host" (permissions, disk, another agent holding
# the lock), not "this file is damaged": those fail fast instead of throwing the state away
_ENVIRONMENT_CODES = {3, 5, 6, 8, 10, 13, 14}  # PERM BUSY LOCKED READONLY IOERR FULL CANTOPEN


class _Damaged(Exception):
    """The database file exists but is not a usable state store (the reason says why)."""


class StateStore:
    def __init__(self, state_dir: Path, on_error: Callable[[str], None] | None = None) -> None:
        """Open (or create) the store. A damaged file is moved aside and replaced by an empty
        store, reported through ``on_error``: an always-on agent that loses its offsets re-reads
        logs once, which is far better than not running. An unusable *directory* still fails,
        unless the cause is transient (disk full, I/O error): then the store starts *unavailable*
        (``unavailable`` holds the error), what is on disk is read read-only where it can be, and
        every ``commit`` first tries to open it again: the agent keeps alerting from memory."""
        self.path = Path(state_dir) / DB_NAME
        self.on_error = on_error or (lambda msg: None)
        self.moved_aside: Path | None = None
        self.unavailable: StateError | None = None
        self.quarantined: dict[str, int] = {}  # table -> damaged rows moved to the quarantine table
        self._quarantine: list[tuple[str, tuple[Any, ...], str]] = []  # (table, row, reason) not yet written
        self.db: sqlite3.Connection | None = None
        try:
            _check_dir(Path(state_dir))
            self.db = self._open_or_recover()
        except StateError as exc:
            if not exc.transient:
                raise
            self.unavailable = exc
            self.db = open_read_only(self.path, ("offsets", "alerts"))

    def _open_or_recover(self) -> sqlite3.Connection:
        try:
            return self._open()
        except _Damaged as exc:
            self.moved_aside = quarantine(self.path, time.time())
            self.on_error(f"{self.path}: {exc}; moved it to {self.moved_aside} and started with empty state "
                          "(logs are read again from their start)")
            try:
                return self._open()
            except _Damaged as again:
                raise StateError(f"{self.path}: {again} (even after moving the old file aside)") from again

    def _open(self) -> sqlite3.Connection:
        """Connect, check integrity and schema; raise _Damaged for a bad file, StateError otherwise."""
        db: sqlite3.Connection | None = None
        try:
            db = sqlite3.connect(self.path, timeout=5.0, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            problems = [r[0] for r in db.execute("PRAGMA quick_check(5)").fetchall()]
            if problems != ["ok"]:
                raise _Damaged("integrity check failed: " + "; ".join(str(p) for p in problems))
            db.executescript(_SCHEMA)
            for table, columns in _TABLES.items():
                found = tuple(r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall())
                if found != columns:
                    raise _Damaged(f"table {table} has columns {found}, expected {columns}")
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif not str(row[0]).isdigit():
                raise _Damaged(f"schema version {row[0]!r} is not a number")
            elif int(row[0]) > SCHEMA_VERSION:  # a newer agent's state: refuse rather than destroy it
                raise StateError(f"{self.path}: schema version {row[0]} is newer than this agent "
                                 f"({SCHEMA_VERSION})", "newer schema")
            return db
        except (_Damaged, StateError):
            _close(db)
            raise
        except sqlite3.DatabaseError as exc:
            _close(db)
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF in _ENVIRONMENT_CODES:
                raise state_error(self.path, exc) from exc
            raise _Damaged(f"not a usable SQLite database ({exc})") from exc
        except (sqlite3.Error, OSError) as exc:
            _close(db)
            raise state_error(self.path, exc) from exc

    # -- reads (start-up) ---------------------------------------------------------------------
    # A row that cannot be decoded, or decodes to something impossible, is quarantined (repair.py):
    # one bad row must not cost the rest, nor be read again at every start.
    def load_offsets(self) -> dict[str, TailPosition]:
        out: dict[str, TailPosition] = {}
        for r in self._query("SELECT path, dev, ino, offset, line FROM offsets"):
            why = check_position(r)
            if why is None:
                out[r[0]] = TailPosition(r[1], r[2], r[3], r[4])
                continue
            pos, where = safe_position(r)
            self.quarantine("offsets", r, why, f"; {where}")
            if pos is not None:
                out[r[0]] = pos
        return out

    def load_alerts(self) -> list[Alert]:
        return self._decode("alerts", "SELECT fingerprint, rule, labels, state, active_at, last_seen, fired_at,"
                                      " resolved_at, annotations, finding, count FROM alerts", _alert)

    def load_series(self) -> list[SeriesState]:
        return self._decode("series", "SELECT labels, data FROM series ORDER BY updated",
                            lambda r: SeriesState.from_dict(_labels(r[0]), json.loads(r[1])))

    def load_scanned(self) -> dict[str, tuple[int, int, int, float, str]]:
        rows = self._decode("scanned", "SELECT path, dev, ino, size, mtime, status FROM scanned",
                            lambda r: (str(r[0]), (int(r[1]), int(r[2]), int(r[3]), float(r[4]), str(r[5]))))
        return dict(rows)

    def load_memory(self) -> list[tuple[str, str, str, str, str, int]]:
        """Detector memory rows (rule, slot, key, digest, data, seq), oldest first; their data is
        decoded by agent/store/book.py, which hands a bad row back to ``quarantine``."""
        return self._decode("memory", "SELECT rule, slot, key, digest, data, seq FROM memory ORDER BY seq",
                            lambda r: (str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), int(r[5])))

    def _decode(self, table: str, sql: str, decode: Callable[[tuple[Any, ...]], T]) -> list[T]:
        out: list[T] = []
        for r in self._query(sql):
            try:
                out.append(decode(r))
            except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as exc:
                self.quarantine(table, r, f"{type(exc).__name__}: {str(exc)[:200]}")
        return out

    @property
    def pending(self) -> bool:
        """Damaged rows wait to be moved to the quarantine table: the next commit must happen."""
        return bool(self._quarantine)

    def quarantine(self, table: str, row: tuple[Any, ...], reason: str, what_next: str = "") -> None:
        """Set a damaged row aside: reported (one ``state`` error per table and start), counted in
        ``quarantined``, moved to the quarantine table by the next commit."""
        n = self.quarantined.get(table, 0)
        self.quarantined[table] = n + 1
        self._quarantine.append((table, tuple(row), reason))
        if n == 0:
            self.on_error(f"{self.path}: quarantined a damaged row of table {table} ({reason}{what_next}); "
                          "further damaged rows of that table are counted in "
                          "precision_agent_state_rows_quarantined_total")

    # -- writes ------------------------------------------------------------------------------
    def commit(self, *, offsets: dict[str, TailPosition] | None = None, alerts: Iterable[Alert] = (),
               deleted_alerts: Iterable[str] = (), series: Iterable[SeriesState] = (),
               forget_offsets: Iterable[str] = (), forget_series: Iterable[Labels] = (),
               memory: MemoryDelta | None = None, dump_origins: list[Any] | None = None) -> None:
        """Write one batch in one transaction, or nothing: raises StateError naming the cause
        (the error SQLite gave, never that of the rollback after it). ``dump_origins``: the dump
        side's origin records (agent/dumps/origins.py), when they changed."""
        db = self._writable()
        now = time.time()
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                write_quarantine(db, self._quarantine, now)  # first: this batch may rewrite those keys
                if offsets:
                    db.executemany(
                        "INSERT OR REPLACE INTO offsets VALUES (?,?,?,?,?,?)",
                        [(p, pos.dev, pos.ino, pos.offset, pos.line, now) for p, pos in offsets.items()])
                db.executemany("DELETE FROM offsets WHERE path=?", [(p,) for p in forget_offsets])
                db.executemany(
                    "INSERT OR REPLACE INTO alerts VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    [(a.fingerprint, a.rule, _dump_labels(a.labels), a.state.value, a.active_at, a.last_seen,
                      a.fired_at, a.resolved_at, json.dumps(a.annotations), json.dumps(a.finding, default=str),
                      a.count) for a in alerts])
                db.executemany("DELETE FROM alerts WHERE fingerprint=?", [(f,) for f in deleted_alerts])
                db.executemany(
                    "INSERT OR REPLACE INTO series VALUES (?,?,?)",
                    [(_dump_labels(s.labels), json.dumps(s.to_dict(context=True)), s.last_update) for s in series])
                db.executemany("DELETE FROM series WHERE labels=?",
                               [(_dump_labels(k),) for k in forget_series])
                if memory:
                    self._write_memory(db, memory)
                if dump_origins is not None:
                    _write_origins(db, dump_origins)
                db.execute("COMMIT")
            except BaseException:
                _rollback(db)  # SQLite may have rolled back already (disk full): keep the first error
                raise
        except sqlite3.Error as exc:
            raise state_error(self.path, exc) from exc
        self._quarantine.clear()

    def _writable(self) -> sqlite3.Connection:
        """The read-write connection; while the store is unavailable, try to open it again."""
        if self.unavailable is None and self.db is not None:
            return self.db
        try:
            _check_dir(self.path.parent)
            db = self._open_or_recover()
        except StateError as exc:
            self.unavailable = exc
            raise
        _close(self.db)  # the read-only view of start-up
        self.db, self.unavailable = db, None
        return db

    def _write_memory(self, db: sqlite3.Connection, m: MemoryDelta) -> None:
        if m.keep is not None:  # rows of removed rules, or of an earlier version of a rule
            stale = [(r, d) for r, d in db.execute("SELECT DISTINCT rule, digest FROM memory")
                     if m.keep.get(r) != d]
            db.executemany("DELETE FROM memory WHERE rule=? AND digest=?", stale)
        db.executemany("DELETE FROM memory WHERE rule=?", [(r,) for r, s in m.clear if s is None])
        db.executemany("DELETE FROM memory WHERE rule=? AND slot=?",
                            [(r, s) for r, s in m.clear if s is not None])
        db.executemany("DELETE FROM memory WHERE rule=? AND slot=? AND key=?", m.deletes)
        db.executemany("INSERT OR REPLACE INTO memory VALUES (?,?,?,?,?,?)", m.upserts)

    def record_scanned(self, path: str, dev: int, ino: int, size: int, mtime: float, status: str) -> None:
        db = self._writable()
        try:
            db.execute("INSERT OR REPLACE INTO scanned VALUES (?,?,?,?,?,?,?)",
                       (path, dev, ino, size, mtime, status, time.time()))
        except sqlite3.Error as exc:
            raise state_error(self.path, exc) from exc

    # -- the dump side's first non-finite dump per rank (agent/dumps/origins.py) -----------------
    # One JSON row in ``meta`` (bounded by the origins' own cap), rewritten when a record changes.
    # The daemon writes it with the batch (``commit(dump_origins=...)``); a save that failed is
    # retried by the next commit, as offsets and alerts are.
    def save_dump_origins(self, rows: list[Any]) -> None:
        db = self._writable()
        try:
            _write_origins(db, rows)
        except sqlite3.Error as exc:
            raise state_error(self.path, exc) from exc

    def load_dump_origins(self) -> list[Any]:
        """The saved rows; unreadable ones are the caller's to skip (DumpOrigins.restore)."""
        got = self._decode("meta", "SELECT value FROM meta WHERE key='dump_origins'", lambda r: json.loads(r[0]))
        return got[0] if got and isinstance(got[0], list) else []

    def close(self) -> None:
        _close(self.db)

    def _query(self, sql: str) -> list[tuple[Any, ...]]:
        if self.db is None:  # unavailable at start and nothing readable on disk: start empty
            return []
        try:
            return self.db.execute(sql).fetchall()
        except sqlite3.Error as exc:
            raise state_error(self.path, exc) from exc


def _write_origins(db: sqlite3.Connection, rows: list[Any]) -> None:
    db.execute("INSERT OR REPLACE INTO meta VALUES ('dump_origins', ?)", (json.dumps(rows),))


def _dump_labels(labels: Labels) -> str:
    return json.dumps(list(labels), separators=(",", ":"))


def _alert(r: tuple[Any, ...]) -> Alert:
    times = [r[4], r[5]] + [t for t in (r[6], r[7]) if t is not None]
    if not all(type(t) in (int, float) and t == t for t in times) or type(r[10]) is not int:
        raise ValueError("a time or the count is not a number")
    annotations, finding = json.loads(r[8]), json.loads(r[9])
    if not isinstance(annotations, dict) or not isinstance(finding, dict):
        raise ValueError("annotations or finding is not an object")
    return Alert(str(r[0]), str(r[1]), _labels(r[2]), AlertState(r[3]), r[4], r[5], r[6], r[7], annotations,
                 finding, r[10])


def _labels(raw: str) -> Labels:
    return tuple((str(k), str(v)) for k, v in json.loads(raw))


def _close(db: sqlite3.Connection | None) -> None:
    if db is not None:
        try:
            db.close()
        except sqlite3.Error:
            pass


def _rollback(db: sqlite3.Connection) -> None:
    if db.in_transaction:
        try:
            db.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def _check_dir(state_dir: Path) -> None:
    """Create the state directory and prove it is writable; a host problem is a config error
    (exit 2 with the path and the reason), never a reason to run without state."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=state_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if cause_of(exc) in TRANSIENT_CAUSES:  # a full disk is no configuration error
            raise StateError(f"{state_dir}: {exc.strerror or exc}", cause_of(exc)) from exc
        raise ConfigError(str(state_dir), "state_dir",
                          f"cannot use it as the state directory: {exc.strerror or exc}") from exc


def quarantine(db_path: Path, now: float) -> Path:
    """Move a damaged database and its -wal/-shm to ``<name>.corrupt-<UTC time>`` (kept for a
    post-mortem) and delete all but the newest KEEP_CORRUPT such copies. Returns the new path."""
    # fixed-width stamp down to microseconds: names sort by age and never repeat a pruned one
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1e6) % 1_000_000:06d}Z"
    target = db_path.with_name(f"{db_path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = db_path.with_name(f"{db_path.name}.corrupt-{stamp}-{n}")
        n += 1
    for suffix in ("-wal", "-shm", ""):  # the main file last: a crash in between leaves no stray log
        src = db_path.with_name(db_path.name + suffix)
        try:
            os.replace(src, target.with_name(target.name + suffix))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StateError(f"{db_path}: damaged, and it cannot be moved aside: {exc.strerror or exc}") from exc
    _prune(db_path)
    return target


def _prune(db_path: Path) -> None:
    prefix = f"{db_path.name}.corrupt-"
    kept = sorted((p for p in db_path.parent.iterdir()
                   if p.name.startswith(prefix) and not p.name.endswith(("-wal", "-shm"))),
                  key=lambda p: p.name)
    for old in kept[:-KEEP_CORRUPT] if len(kept) > KEEP_CORRUPT else []:
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(old.with_name(old.name + suffix))
            except OSError:
                pass

