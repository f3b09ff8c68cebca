"""The daemon's periodic jobs (resync request, stall check, systemd watchdog ping) on one thread.

Each job only enqueues work or reads a few numbers, so one thread runs them all in turn: a job
that is late runs once, not once per missed interval (coalesced), and never overlaps itself. It
replaces a general scheduler library whose import alone cost ~6 MB of resident memory (asyncio
included) and whose executor added threads at run time; this keeps the agent's thread count
fixed (see daemon/threads.py)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("precision_agent")


@dataclass(slots=True)
class _Job:
    name: str
    fn: Callable[[], object]
    interval: float
    due: float


class Ticker:
    """``add`` jobs, ``start`` the thread, ``shutdown`` it (idempotent; also before ``start``)."""

    def __init__(self, name: str = "timers") -> None:
        self.name = name
        self._jobs: list[_Job] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, fn: Callable[[], object], seconds: float, name: str) -> None:
        if seconds <= 0:
            raise ValueError(f"job {name}: interval must be positive, not {seconds}")
        self._jobs.append(_Job(name, fn, float(seconds), time.monotonic() + seconds))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while self._jobs:
            job = min(self._jobs, key=lambda j: j.due)
            if self._stop.wait(max(0.0, job.due - time.monotonic())):
                return
            try:
                job.fn()
            except Exception:  # a job's bug is logged; the job runs again at its next time
                log.exception("periodic job %s failed", job.name)
            now = time.monotonic()
            job.due += job.interval
            if job.due <= now:  # late (a suspended host, a long job): once now, not once per miss
                job.due = now + job.interval
        self._stop.wait()
