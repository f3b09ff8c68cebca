"""When to scan a dump directory, and scanning it off the daemon's main worker.

A training job writes a dump directory file by file; scanning half a directory would report
nonsense (or the same op twice). A directory is therefore scanned once it has been quiet for
``settle`` seconds (no change event, and no file modified, for that long), and only if its signature (file count, total size, newest mtime) differs from
the one already scanned: a restart, or an event for an unchanged file, scans nothing again.
Scans run one at a time on their own thread, fed by a bounded queue; results come back through
an inbox the main worker drains, so the pipeline keeps a single owner.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model import DUMP_NONFINITE, Sample, SourcePos, make_labels
from .scan import scan

log = logging.getLogger(__name__)
MAX_UNIT_FILES = 100_000


def unit_of(path: str) -> str:
    """The directory a dump file belongs to (msprobe keeps tensors one level down)."""
    d = os.path.dirname(path)
    return os.path.dirname(d) if os.path.basename(d) == "dump_tensor_data" else d


def signature(unit: str) -> tuple[int, int, int] | None:
    """(files, bytes, newest mtime in ns) of a directory tree; None if it is gone."""
    n = size = newest = 0
    try:
        for dirpath, _dirs, files in os.walk(unit):
            for f in files:
                try:
                    st = os.stat(os.path.join(dirpath, f))
                except OSError:
                    continue
                n, size, newest = n + 1, size + st.st_size, max(newest, st.st_mtime_ns)
                if n >= MAX_UNIT_FILES:
                    return n, size, newest
    except OSError:
        return None
    return (n, size, newest) if n else None


@dataclass
class ScanResult:
    unit: str
    signature: tuple[int, int, int]
    result: dict[str, Any] | None
    error: str | None = None


def result_sample(r: ScanResult, labels: dict[str, str]) -> Sample | None:
    """The scan's first bad op as a sample for the ``dump_nonfinite`` rules (None if none)."""
    first = r.result["first_nonfinite"] if r.result else None
    if first is None:
        return None
    labels = dict(labels)
    if first.get("rank") is not None:
        labels["rank"] = str(first["rank"])
    bad = next((t for t in r.result["tensors"] if t["name"] == first["op"] and t["step"] == first["step"]
                and f"{t['io']}[{t['index']}]" == first["tensor"]), {})
    nonfinite = (bad.get("nan") or 0) + (bad.get("pos_inf") or 0) + (bad.get("neg_inf") or 0)
    attrs = (("op", first["op"]), ("tensor", first["tensor"]), ("rank", first["rank"]), ("nonfinite", nonfinite),
             ("dtype", bad.get("dtype")), ("max", bad.get("max")), ("min", bad.get("min")))
    return Sample(make_labels(labels), DUMP_NONFINITE, float(nonfinite), first["step"], SourcePos(r.unit, 0),
                  time.time(), None, attrs)


class DumpScheduler:
    def __init__(self, settle: float, queue_size: int, scanned: dict[str, tuple[int, int, int]]) -> None:
        self.settle = settle
        self.scanned = scanned                       # unit -> signature already scanned
        self.pending: dict[str, float] = {}          # unit -> monotonic time of its last change
        self.queued: set[str] = set()
        self.queue: queue.Queue[tuple[str, tuple[int, int, int]] | None] = queue.Queue(maxsize=queue_size)
        self.inbox: deque[ScanResult] = deque()
        self._thread = threading.Thread(target=self._run, name="dump-scan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=30)

    def touched(self, path: str, now: float | None = None) -> None:
        self.pending[unit_of(path)] = time.monotonic() if now is None else now

    def due(self, now: float | None = None) -> None:
        """Queue the units that have been quiet for ``settle`` and changed since their last scan."""
        now = time.monotonic() if now is None else now
        for unit, changed in list(self.pending.items()):
            if now - changed < self.settle or unit in self.queued:
                continue
            sig = signature(unit)
            if sig is None or self.scanned.get(unit) == sig:
                del self.pending[unit]
                continue
            if time.time() - sig[2] / 1e9 < self.settle:
                continue  # a file in it was written moments ago: the job may still be writing
            try:
                self.queue.put_nowait((unit, sig))
            except queue.Full:
                return  # stays pending: the scan thread is busy, try again later
            del self.pending[unit]
            self.queued.add(unit)

    def drain(self) -> list[ScanResult]:
        out = []
        while self.inbox:
            r = self.inbox.popleft()
            self.queued.discard(r.unit)
            if r.error is None:
                self.scanned[r.unit] = r.signature
            out.append(r)
        return out

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            unit, sig = item
            try:
                self.inbox.append(ScanResult(unit, sig, scan(Path(unit))))
            except Exception as exc:  # a reader bug must not kill the scan thread
                log.exception("scanning %s failed", unit)
                self.inbox.append(ScanResult(unit, sig, None, repr(exc)))
