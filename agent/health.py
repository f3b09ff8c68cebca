"""The agent's own health counters, shared by every thread and exported on /metrics.

Every error kind is listed up front so it is exported at 0 before the first error: a rule
such as ``increase(precision_agent_errors_total[5m]) > 0`` needs a sample before the increment.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

ERROR_KINDS = ("config", "rule_file", "read", "parse", "state", "watch", "scan", "compare", "http", "notify",
               "internal")
COUNTERS = ("log_lines_read", "log_bytes_read", "log_records_parsed", "log_lines_truncated",
            "metric_records_skipped",
            "log_rotations", "log_truncations", "dump_files_scanned", "watch_events", "resyncs",
            "queue_overflows", "symlinks_skipped", "dump_unreadable_io", "dump_unreadable_truncated",
            "dump_unreadable_limit", "dump_unreadable_invalid", "rule_reloads_success", "rule_reloads_failure", "config_reloads_success",
            "config_reloads_failure")

log = logging.getLogger("precision_agent")


class Health:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {name: 0.0 for name in COUNTERS}
        self.errors: dict[str, float] = {kind: 0.0 for kind in ERROR_KINDS}
        self.gauges: dict[str, float] = {"watched_log_files": 0.0, "watched_dump_files": 0.0,
                                         "rule_files_ok": 0.0, "rule_files_error": 0.0, "rules_loaded": 0.0,
                                         "last_commit_timestamp_seconds": 0.0, "ready": 0.0,
                                         "config_restart_needed": 0.0, "state_unsaved": 0.0,
                                         "log_files_unrecognized": 0.0, "log_unread_bytes": 0.0,
                                         "log_files_behind": 0.0, "log_files_open": 0.0, "max_open_files": 0.0,
                                         "max_open_files_lowered": 0.0}
        # counters with one label: (name, label value) -> count (e.g. state save failures by cause)
        self.labelled: dict[tuple[str, str], float] = {}
        self.start_time = time.time()
        self.last_error: dict[str, str] = {}
        # worker name -> a callable listing its heartbeats (a worker may run on several threads)
        self.workers: dict[str, Callable[[], list[Heartbeat]]] = {}
        self.stall_timeout = 30.0

    def add_worker(self, name: str, beats: Callable[[], list["Heartbeat"]]) -> None:
        self.workers[name] = beats

    def worker_states(self, now: float | None = None) -> list[tuple[str, float, bool]]:
        """(worker, last heartbeat in seconds since the epoch, stalled) per worker."""
        now = time.monotonic() if now is None else now
        out = []
        for name, beats in self.workers.items():
            hbs = beats()
            last = max((hb.last_wall for hb in hbs), default=0.0)
            out.append((name, last, any(hb.stalled(self.stall_timeout, now) for hb in hbs)))
        return out

    def stalled_workers(self) -> list[str]:
        return [name for name, _, stalled in self.worker_states() if stalled]

    def inc(self, name: str, amount: float = 1.0) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0.0) + amount

    def inc_labelled(self, name: str, label: str, amount: float = 1.0) -> None:
        with self._lock:
            self.labelled[(name, label)] = self.labelled.get((name, label), 0.0) + amount

    def labelled_snapshot(self, name: str) -> dict[str, float]:
        with self._lock:
            return {label: v for (n, label), v in self.labelled.items() if n == name}

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = value

    def error(self, kind: str, message: str, *args: object, logged: bool = True) -> None:
        """Count an error of ``kind`` and log it: every bad input gets a log line and a metric.
        ``logged=False``: counted only, for a repeat whose line was already written (a dump file
        unreadable for the same reason since it last changed, agent/daemon/dumpflow.py)."""
        if kind not in self.errors:
            kind = "internal"
        with self._lock:
            self.errors[kind] += 1
            self.last_error[kind] = message % args if args else message
        if logged:
            log.error("%s error: " + message, kind, *args)

    def snapshot(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        with self._lock:
            return dict(self.counters), dict(self.errors), dict(self.gauges)


class Cancelled(Exception):
    """Raised by :func:`beat` in a thread whose heartbeat was cancelled (the agent is stopping)."""


class Heartbeat:
    """One worker thread's progress: ``beat()`` whenever it gets something done; ``busy`` while
    it has work. A worker that is busy and has not beaten for the stall timeout is stuck."""

    def __init__(self, name: str, busy: bool = False) -> None:
        self.name = name
        self.last = time.monotonic()
        self.last_wall = time.time()
        self.busy = busy
        self.cancelled = False
        self.what = ""            # what the worker is busy with (for the stall's log line)

    def beat(self) -> None:
        self.last = time.monotonic()
        self.last_wall = time.time()

    def working(self, busy: bool = True) -> None:
        self.beat()
        self.busy = busy

    def stalled(self, timeout: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.busy and now - self.last > timeout


_local = threading.local()


def bind(hb: Heartbeat | None) -> None:
    """Make ``hb`` the heartbeat that :func:`beat` feeds on the calling thread."""
    _local.hb = hb


def bound() -> Heartbeat | None:
    """The heartbeat bound on the calling thread (helpers it starts bind the same one)."""
    return getattr(_local, "hb", None)


def beat() -> None:
    """Progress on the calling thread (a no-op where no heartbeat is bound): deep loops such as
    the scanner's chunk reads call this, so a long but moving scan is not taken for a hang."""
    hb = getattr(_local, "hb", None)
    if hb is not None:
        if hb.cancelled:
            raise Cancelled(hb.name)
        hb.beat()
