"""When to scan a dump directory, and scanning it off the daemon's main worker.

A training job writes a dump directory file by file; scanning half a directory would report
nonsense (or the same op twice). A directory is therefore scanned once it has been quiet for
``settle`` seconds (no change event, and no file modified, for that long), and only if its signature (file count, total size, newest mtime) differs from
the one already scanned: a restart, or an event for an unchanged file, scans nothing again.
Scans run one at a time on their own thread, fed by a bounded queue; results come back through
an inbox the main worker drains, so the pipeline keeps a single owner.

The scan thread has a heartbeat (agent/health.py), fed as it reads (per chunk, per tensor). A
scan that makes no progress for the stall timeout (a file stuck in the kernel: a hung network
mount) is reported once, the worker counts as stalled (readiness, watchdog, metric) until that
scan returns, and a fresh scan thread takes over the queue, so one stuck file never stops the
other trees (at most ``MAX_STUCK`` stuck threads are left behind).
"""

from __future__ import annotations

import json

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

from ..health import Cancelled, Heartbeat, bind
from ..model import DUMP_FP16_SATURATED, DUMP_NONFINITE, DUMP_OVERFLOW, Labels, Sample, SourcePos, make_labels
from .scan import scan_dump

try:  # tensor-health watchpoints: a separate module, used as soon as it exists
    from .watchpoints import tensor_samples
except ModuleNotFoundError as exc:
    if exc.name != f"{__package__}.watchpoints":
        raise  # a module *it* imports is missing: a real error, not "not there yet"
    tensor_samples = None

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


def labelled(samples: list[Sample], labels: dict[str, str]) -> list[Sample]:
    """The scan thread's samples under a watch's labels (a sample's own, e.g. rank, win)."""
    if labels:
        for s in samples:
            s.labels = make_labels({**labels, **dict(s.labels)})
    return samples


MAX_OPS_PER_STEP = 16  # overflow / saturation samples per (step, rank): bounds the op labels


def _located(labels: dict[str, str], rank: Any) -> Labels:
    return make_labels(labels, rank=str(rank)) if rank is not None else make_labels(labels)


def fusion_attrs(found: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """A fusion suspect (agent/fusion/suspect.py) as sample attributes, for the fusion_suspect kind."""
    if not found or not found.get("kind"):
        return ()
    return (("fusion_kind", found["kind"]), ("fusion_api", found.get("api")),
            ("fusion_passes", tuple(found.get("passes") or ())), ("fusion_advice", found.get("advice") or ""),
            ("fusion_switch_cfg", json.dumps(found["switch_cfg"]) if found.get("switch_cfg") else None),
            ("fusion_fused_ops", tuple(found.get("fused_ops") or ())))


def _nonfinite_sample(result: dict[str, Any], labels: dict[str, str], src: SourcePos, now: float,
                      ) -> list[Sample]:
    first = result.get("first_nonfinite")
    if first is None:
        return []
    bad = next((t for t in result["tensors"] if t["name"] == first["op"] and t["step"] == first["step"]
                and t["rank"] == first["rank"] and f"{t['io']}[{t['index']}]" == first["tensor"]), {})
    nonfinite = (bad.get("nan") or 0) + (bad.get("pos_inf") or 0) + (bad.get("neg_inf") or 0)
    attrs = (("op", first["op"]), ("tensor", first["tensor"]), ("rank", first["rank"]), ("nonfinite", nonfinite),
             ("dtype", bad.get("dtype")), ("max", bad.get("max")), ("min", bad.get("min")),
             *fusion_attrs(result.get("fusion_suspect")))
    return [Sample(_located(labels, first["rank"]), DUMP_NONFINITE, float(nonfinite), first["step"], src, now,
                   None, attrs)]


def _overflow_samples(result: dict[str, Any], labels: dict[str, str], src: SourcePos, now: float,
                      ) -> list[Sample]:
    """One sample per overflowing op, earliest debug file first, at most MAX_OPS_PER_STEP
    distinct ops per (step, rank)."""
    seen: dict[tuple, set[str]] = {}
    out = []
    # no non-finite op: the first overflowing op is the scan's first bad op, and carries its suspicion
    fusion = () if result.get("first_nonfinite") else fusion_attrs(result.get("fusion_suspect"))
    for o in result.get("overflows") or []:
        op = o["op"] or f"task{o['task_id']}_stream{o['stream_id']}"  # its dump file is missing
        ops = seen.setdefault((o["step"], o["rank"]), set())
        if op in ops or len(ops) >= MAX_OPS_PER_STEP:
            continue
        ops.add(op)
        attrs = (("op", op), ("op_type", o["op_type"]), ("accelerator", o["accelerator"]),
                 ("status", o["status"]), ("status_code", hex(o["status_code"])), ("task_id", o["task_id"]),
                 ("stream_id", o["stream_id"]), ("rank", o["rank"]), ("debug_file", o["debug_file"]),
                 ("dump_file", o["file"]), *fusion)
        fusion = ()
        out.append(Sample(_located(labels, o["rank"]), DUMP_OVERFLOW, 1.0, o["step"], src, now, None, attrs))
    return out


def _saturation_samples(result: dict[str, Any], labels: dict[str, str], src: SourcePos, now: float,
                        ) -> list[Sample]:
    """One sample per op whose outputs hold fp16 values at ±65504, in execution order (the order
    of ``tensors``), at most MAX_OPS_PER_STEP ops per (step, rank); value = saturated count."""
    ops: dict[tuple, dict[str, dict[str, Any]]] = {}
    for t in result["tensors"]:
        if not t.get("fp16_saturated") or t["io"] in ("input", "param"):
            continue
        per_step = ops.setdefault((t["step"], t["rank"]), {})
        if t["name"] in per_step:
            per_step[t["name"]]["saturated"] += t["fp16_saturated"]
        elif len(per_step) < MAX_OPS_PER_STEP:
            per_step[t["name"]] = {"tensor": f"{t['io']}[{t['index']}]", "saturated": t["fp16_saturated"],
                                   "count": t["count"], "max": t["max"], "min": t["min"], "dtype": t["dtype"]}
    out = []
    for (step, rank), per_step in ops.items():
        for op, e in per_step.items():
            attrs = (("op", op), ("rank", rank), *e.items())
            out.append(Sample(_located(labels, rank), DUMP_FP16_SATURATED, float(e["saturated"]), step, src,
                              now, None, attrs))
    return out


def result_samples(result: dict[str, Any], labels: dict[str, str], source: str | None = None) -> list[Sample]:
    """Everything a scan result tells the rules, as samples: the first bad op (``dump_nonfinite``),
    the overflowing ops (``dump_overflow``), the fp16-saturated ops (``dump_fp16_saturated``)
    and the tensor-health watchpoints' samples. The daemon and ``precision-agent scan`` both
    judge exactly these, so the two cannot disagree."""
    src, now = SourcePos(source or result.get("path", ""), 0), time.time()
    out = _nonfinite_sample(result, labels, src, now)
    out += _overflow_samples(result, labels, src, now)
    out += _saturation_samples(result, labels, src, now)
    if tensor_samples is not None:  # the one call site of the watchpoint kinds' samples
        out += tensor_samples(result, labels)
    return out


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
                 on_stall: Callable[[str], None] | None = None) -> None:
        self.settle = settle
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
            result = scan_dump(Path(unit), drop_cache=not keep)
            if self.fusion is not None:
                self.fusion(unit, result)
            r = ScanResult(unit, sig, result, samples=result_samples(result, {}, unit))
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
