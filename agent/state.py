"""The state store: one SQLite file (stdlib, WAL) holding everything a restart must not lose.

Tailer offsets, the scanned-file index, alert states and series summaries are written in one
transaction per processing batch, *after* the batch's samples went through the pipeline, so
a restart resumes exactly where the last committed batch ended and does not re-page alerts.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable

from .model import Alert, AlertState, Labels
from .readers.tailer import TailPosition
from .series import SeriesState

SCHEMA_VERSION = 1
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
"""


class StateError(Exception):
    """The state store could not be read or written (disk full, corrupt file, permissions)."""


class StateStore:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / DB_NAME
        try:
            Path(state_dir).mkdir(parents=True, exist_ok=True, mode=0o750)
            self.db = sqlite3.connect(self.path, timeout=5.0, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self.db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise StateError(f"{self.path}: schema version {row[0]} is newer than this agent ({SCHEMA_VERSION})")
        except (sqlite3.Error, OSError) as exc:
            raise StateError(f"{self.path}: {exc}") from exc

    # -- reads (start-up) ---------------------------------------------------------------------
    def load_offsets(self) -> dict[str, TailPosition]:
        rows = self._query("SELECT path, dev, ino, offset, line FROM offsets")
        return {r[0]: TailPosition(r[1], r[2], r[3], r[4]) for r in rows}

    def load_alerts(self) -> list[Alert]:
        out = []
        for r in self._query("SELECT fingerprint, rule, labels, state, active_at, last_seen, fired_at,"
                             " resolved_at, annotations, finding, count FROM alerts"):
            out.append(Alert(r[0], r[1], _labels(r[2]), AlertState(r[3]), r[4], r[5], r[6], r[7],
                             json.loads(r[8]), json.loads(r[9]), r[10]))
        return out

    def load_series(self) -> list[SeriesState]:
        return [SeriesState.from_dict(_labels(r[0]), json.loads(r[1]))
                for r in self._query("SELECT labels, data FROM series ORDER BY updated")]

    def load_scanned(self) -> dict[str, tuple[int, int, int, float, str]]:
        rows = self._query("SELECT path, dev, ino, size, mtime, status FROM scanned")
        return {r[0]: (r[1], r[2], r[3], r[4], r[5]) for r in rows}

    # -- writes ------------------------------------------------------------------------------
    def commit(self, *, offsets: dict[str, TailPosition] | None = None, alerts: Iterable[Alert] = (),
               deleted_alerts: Iterable[str] = (), series: Iterable[SeriesState] = (),
               forget_offsets: Iterable[str] = (), forget_series: Iterable[Labels] = ()) -> None:
        now = time.time()
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                if offsets:
                    self.db.executemany(
                        "INSERT OR REPLACE INTO offsets VALUES (?,?,?,?,?,?)",
                        [(p, pos.dev, pos.ino, pos.offset, pos.line, now) for p, pos in offsets.items()])
                self.db.executemany("DELETE FROM offsets WHERE path=?", [(p,) for p in forget_offsets])
                self.db.executemany(
                    "INSERT OR REPLACE INTO alerts VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    [(a.fingerprint, a.rule, _dump_labels(a.labels), a.state.value, a.active_at, a.last_seen,
                      a.fired_at, a.resolved_at, json.dumps(a.annotations), json.dumps(a.finding, default=str),
                      a.count) for a in alerts])
                self.db.executemany("DELETE FROM alerts WHERE fingerprint=?", [(f,) for f in deleted_alerts])
                self.db.executemany(
                    "INSERT OR REPLACE INTO series VALUES (?,?,?)",
                    [(_dump_labels(s.labels), json.dumps(s.to_dict()), s.last_update) for s in series])
                self.db.executemany("DELETE FROM series WHERE labels=?",
                                    [(_dump_labels(k),) for k in forget_series])
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StateError(f"{self.path}: {exc}") from exc

    def record_scanned(self, path: str, dev: int, ino: int, size: int, mtime: float, status: str) -> None:
        try:
            self.db.execute("INSERT OR REPLACE INTO scanned VALUES (?,?,?,?,?,?,?)",
                            (path, dev, ino, size, mtime, status, time.time()))
        except sqlite3.Error as exc:
            raise StateError(f"{self.path}: {exc}") from exc

    def close(self) -> None:
        try:
            self.db.close()
        except sqlite3.Error:
            pass

    def _query(self, sql: str) -> list[tuple[Any, ...]]:
        try:
            return self.db.execute(sql).fetchall()
        except sqlite3.Error as exc:
            raise StateError(f"{self.path}: {exc}") from exc


def _dump_labels(labels: Labels) -> str:
    return json.dumps(list(labels), separators=(",", ":"))


def _labels(raw: str) -> Labels:
    return tuple((str(k), str(v)) for k, v in json.loads(raw))
