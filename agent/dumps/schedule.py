"""When to scan a dump directory, and scanning it off the daemon's main worker.

A training job writes a dump directory file by file; scanning half a directory would report
nonsense (or the same op twice). A directory is therefore scanned once it has been quiet for
``settle`` seconds (no change event, and no file modified, for that long), and only if its signature (file count, total size, newest mtime) differs from
the one already scanned: a restart, or an event for an unchanged file, scans nothing again.
A unit is one directory's own files (:func:`unit_files`; a sub-folder is a unit of its own), so
each file is scanned in one unit under one name; a rescan reads only the files that changed
(agent/dumps/cache.py), so a flat root that grows at every step is not re-read whole each time.
Scans run one at a time on their own thread, fed by a bounded queue; results come back through
an inbox the main worker drains, so the pipeline keeps a single owner. Within a scan, up to
``jobs`` files are read at once (``limits.scan_jobs``, default 1), by threads the scan thread
starts: they inherit its nice value and idle I/O class and feed its heartbeat.

The scan thread has a heartbeat (agent/health.py), fed as it reads (per chunk, per tensor). A
scan that makes no progress for the stall timeout (a file stuck in the kernel: a hung network
mount) is reported once, the worker counts as stalled (readiness, watchdog, metric) until that
scan returns, and a fresh scan thread takes over the queue, so one stuck file never stops the
other trees (at most ``MAX_STUCK`` stuck threads are left behind).
"""

from __future__ import annotations


import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import nullcontext
from typing import Any, Callable, ContextManager

from ..health import Cancelled, Heartbeat, beat, bind
from .cache import ScanCache
from .discovery import Walk
from .scan import scan_dump

from ..model import Sample
from .samples import result_samples

log = logging.getLogger(__name__)
MAX_UNIT_FILES = 100_000


def unit_of(path: str) -> str:
    """The directory a dump file belongs to (msprobe keeps tensors one level down)."""
    d = os.path.dirname(path)
    return os.path.dirname(d) if os.path.basename(d) == "dump_tensor_data" else d


def unit_files(unit: str, limit: int = MAX_UNIT_FILES) -> Walk:
    """The files that belong to ``unit`` (those whose :func:`unit_of` it is), sorted: its own
    files and those of its ``dump_tensor_data/``. A sub-folder is a unit of its own, so every
    file is scanned in exactly one unit and named once (a dump root with files beside its step
    folders never rescans, nor renames, the folders' tensors)."""
    out = Walk()
    for folder in (unit, os.path.join(unit, "dump_tensor_data")):
        try:
            with os.scandir(folder) as it:
                names = sorted(e.name for e in it if not _is_dir(e))
        except OSError as exc:
            if folder == unit:
                out.errors.append((unit, f"cannot list: {exc.strerror or exc}"))
            continue
        for i, name in enumerate(names):
            if i % 1024 == 0:
                beat()   # the worker (signature) or the scan thread: a big folder is progress
            if len(out.files) >= limit:
                out.errors.append((unit, f"stopped after {limit} files: the rest of the folder was not read"))
                return out
            out.files.append(Path(folder) / name)
    return out


def _is_dir(e: os.DirEntry) -> bool:
    """As os.walk sorts them: anything but a folder (a FIFO too: its reader refuses it, reported)."""
    try:
        return e.is_dir()
    except OSError:
        return False


def signature(unit: str) -> tuple[int, int, int] | None:
    """(files, bytes, newest mtime in ns) of a unit's own files (:func:`unit_files`); None if
    it is gone or has none."""
    n = size = newest = 0
    for i, f in enumerate(unit_files(unit).files):
        if i % 1024 == 0:
            beat()
        try:
            st = os.stat(f)
        except OSError:
            continue
        n, size, newest = n + 1, size + st.st_size, max(newest, st.st_mtime_ns)
    return (n, size, newest) if n else None


@dataclass(frozen=True, slots=True)
class RankDigest:
    """One rank's digest of the tensors a dump watch's ``digest:`` regex names, at one step."""

    rank: int | None
    step: int | None
    value: int         # the first 48 bits (a Prometheus sample)
    tensors: int


@dataclass
class AfterScan:
    """The duties a dump watch asks for beyond the scan (compare/live.py), run on the scan thread:
    the cross-rank digests, and the comparison with the benchmark run or rerun."""

    digests: list[RankDigest] = field(default_factory=list)
    compare: dict[str, Any] | None = None   # the comparison's JSON (the `compare --json` document)
    waiting_for: str | None = None          # the other side's directory, not complete yet
    error: str | None = None                # the duties failed (a bug): counted, the scan stands


@dataclass
class ScanResult:
    unit: str
    signature: tuple[int, int, int] | None   # None: no scan, only the after-scan duties ran
    result: dict[str, Any] | None
    error: str | None = None
    # result_samples(result, {}), made on the scan thread: the watchpoint samples read tensor
    # data (weight sketches), which must not hold up the daemon's main worker
    samples: list[Sample] = field(default_factory=list)
    after: AfterScan = field(default_factory=AfterScan)   # comparison and digests
    files_read: int = 0       # files read by this scan (unchanged ones come from the cache)
    # the errors found anew, (path, reason) -> the file's identity (agent/dumps/cache.py); the
    # others were answered from the cache: reported when their file last changed
    fresh_errors: dict[tuple[str, str], tuple | None] = field(default_factory=dict)


AfterScanFn = Callable[[str], "AfterScan"]   # the watch's duties beyond the scan (compare/live.py)
KeepCache = Callable[[str], bool]
MAX_STUCK = 4  # stuck scan threads left behind before the queue waits for one of them
RETRY_MAX, RETRY_GIVE_UP = 600.0, 86400.0  # waiting for a comparison's other side (from max(settle, 1s))
MAX_WAITING = 10_000


class DumpScheduler:
    """Scans settled dump directories on one thread; ``after_scan(unit)`` (comparison, digest)
    runs there too, right after the scan, and again later for a unit that asked to wait
    (``retry_later``: its benchmark side was not complete yet)."""

    def __init__(self, settle: float, queue_size: int, scanned: dict[str, tuple[int, int, int]],
                 after_scan: AfterScanFn | None = None, keep_cache: KeepCache | None = None,
                 on_stall: Callable[[str], None] | None = None, jobs: int = 1) -> None:
        self.settle = settle
        self.jobs = jobs                # files of a unit read at once (limits.scan_jobs)
        self.keep_cache = keep_cache    # unit -> keep its pages in the page cache (a comparison reads them)
        self.on_stall = on_stall        # called once per stuck scan, with a message
        self.scanned = scanned                       # unit -> signature already scanned
        self.after_scan = after_scan
        self.pending: dict[str, float] = {}          # unit -> monotonic time of its last change
        self.waiting: dict[str, tuple[float, float, float]] = {}  # unit -> (next try, delay, first try)
        self.gave_up = 0
        self.queued: set[str] = set()
        self.queue: queue.Queue[tuple[str, tuple[int, int, int] | None] | None] = queue.Queue(maxsize=queue_size)
        self.inbox: deque[ScanResult] = deque()
        self.guard: Callable[[], ContextManager[None]] = nullcontext  # the daemon's symlink confinement
        self.heartbeat = Heartbeat("dump-scan")
        self.fusion: Callable[[str, dict[str, Any]], None] | None = None  # daemon/fusionfiles.py annotate
        self._thread = self._new_thread()
        self._stuck: list[tuple[threading.Thread, Heartbeat]] = []
        self.cache = ScanCache()   # per-file results by identity: a rescan reads only what changed
        self._lock = threading.Lock()

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._guarded_run, args=(self.heartbeat,), name="dump-scan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the scan thread to stop: a scan in progress is cancelled at its next chunk."""
        for hb in self.heartbeats():
            hb.cancelled = True
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=timeout)

    def heartbeats(self) -> list[Heartbeat]:
        """The scan thread's heartbeat and those of stuck threads still running."""
        with self._lock:
            self._stuck = [(t, hb) for t, hb in self._stuck if t.is_alive() and hb.busy]
            return [self.heartbeat] + [hb for _, hb in self._stuck]

    def check_stalled(self, timeout: float, now: float | None = None) -> bool:
        """Main worker: if the scan thread is stuck, report it once and let a fresh thread take
        over the queue. True when a thread was replaced."""
        hb = self.heartbeat
        if not self._thread.is_alive() or not hb.stalled(timeout, now):
            return False
        with self._lock:
            stuck = len([t for t, h in self._stuck if t.is_alive() and h.busy])
            if stuck >= MAX_STUCK:
                return False
            if self.on_stall is not None:
                self.on_stall(f"scan of {hb.what}: no progress for {timeout:.0f} s (a file stuck in the kernel, "
                              f"e.g. a hung network mount?); a new scan thread takes over the other trees")
            self._stuck.append((self._thread, hb))
            self.cache = ScanCache()   # the stuck thread may still write to the old one
            self.heartbeat = Heartbeat("dump-scan")
            self._thread = self._new_thread()
            self._thread.start()
        return True

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
        for unit, (when, _delay, _first) in list(self.waiting.items()):
            if now < when or unit in self.queued:
                continue
            try:
                self.queue.put_nowait((unit, None))  # no new scan: only the after-scan duties
            except queue.Full:
                return
            self.queued.add(unit)

    def retry_later(self, unit: str, now: float | None = None) -> bool:
        """Run ``after_scan(unit)`` again later, backing off; False once it waited a day."""
        now = time.monotonic() if now is None else now
        _when, delay, first = self.waiting.get(unit, (0.0, max(self.settle, 1.0) / 2, now))
        if now - first > RETRY_GIVE_UP or (unit not in self.waiting and len(self.waiting) >= MAX_WAITING):
            self.waiting.pop(unit, None)
            self.gave_up += 1
            return False
        delay = min(delay * 2, RETRY_MAX)
        self.waiting[unit] = (now + delay, delay, first)
        return True

    def done_waiting(self, unit: str) -> None:
        self.waiting.pop(unit, None)

    def drain(self) -> list[ScanResult]:
        out = []
        while self.inbox:
            r = self.inbox.popleft()
            self.queued.discard(r.unit)
            if r.error is None and r.signature is not None:
                self.scanned[r.unit] = r.signature
            out.append(r)
        return out

    def _guarded_run(self, hb: Heartbeat) -> None:
        with self.guard():  # every open on this thread (sources/confine.py)
            self._run(hb)

    def _run(self, hb: Heartbeat) -> None:
        bind(hb)
        while hb is self.heartbeat and not hb.cancelled:
            item = self.queue.get()
            if item is None:
                return
            unit, sig = item
            hb.what = unit
            hb.working(True)
            try:
                self._one(unit, sig)
            except Cancelled:
                return
            finally:
                hb.working(False)

    def _one(self, unit: str, sig: tuple[int, int, int] | None) -> None:
        if sig is None:
            self.inbox.append(ScanResult(unit, None, None, after=self._after(unit)))
            return
        try:
            keep = self.keep_cache is not None and self.keep_cache(unit)
            cache = self.cache   # a thread left stuck keeps this one: check_stalled gives the next its own
            files = unit_files(unit)
            result = scan_dump(Path(unit), drop_cache=not keep, files=files, cache=cache, jobs=self.jobs,
                               guard=self.guard)
            if self.fusion is not None:
                self.fusion(unit, result)
            fresh = {(e["path"], e["reason"]): cache.identity(e["path"]) for e in result["errors"]
                     if (e["path"], e["reason"]) not in cache.replayed}
            r = ScanResult(unit, sig, result, samples=result_samples(result, {}, unit),
                           files_read=cache.files_read(files.files), fresh_errors=fresh)
            cache.begin()   # the per-scan identities and tallies are not kept between scans
        except Cancelled:
            raise
        except Exception as exc:  # a reader bug must not kill the scan thread
            log.exception("scanning %s failed", unit)
            r = ScanResult(unit, sig, None, repr(exc))
        r.after = self._after(unit)
        self.inbox.append(r)

    def _after(self, unit: str) -> AfterScan:
        if self.after_scan is None:
            return AfterScan()
        try:
            return self.after_scan(unit)
        except Cancelled:
            raise
        except Exception as exc:  # a comparison bug must not kill the scan thread either
            log.exception("comparing/digesting %s failed", unit)
            return AfterScan(error=f"{type(exc).__name__}: {exc}"[:500])
