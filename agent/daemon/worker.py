"""The one worker thread: it owns the followed files, the pipeline and the state store, so
detection needs no locks. Each pass takes a batch from the change queue, reads what changed,
hands finished dump scans to the pipeline, ticks time-based rules, pushes alerts and commits
offsets, alerts, series and detector memory in one transaction.

The ``debounce`` coalesces bursts without delaying a lone line: a change that comes after a
quiet ``debounce`` is read at once (a page-worthy line waits for no batch window); a change that
comes sooner after the last read waits until ``debounce`` after it, and everything that arrived
meanwhile is read in that one pass (at most one read per ``debounce`` under a burst)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from ..config import Config
from ..dumps.schedule import ScanResult
from ..engine.alerts import Transition
from ..engine.pipeline import Pipeline
from ..exporters.alertmanager import AlertmanagerPusher
from ..health import Health, Heartbeat, bind
from ..model import AlertState, Labels, Sample
from ..readers.following import Follower
from ..sources.confine import Confinement
from ..sources.queue import Batch, ChangeQueue
from ..sources.watcher import TreeWatcher
from ..store.saving import SaveTracker
from ..store.state import StateError, StateStore
from .dumpflow import DumpFlow
from .heap import give_back
from .reload import Reloader
from .systemd import sd_notify

log = logging.getLogger("precision_agent")

CATCH_UP_FILES = 256  # a pass that moved this many files' positions is a catch-up (see _give_back)
GIVE_BACK_EVERY_S = 60.0  # at most this often (512 ranks writing in bursts must not trim every pass)


class Worker:
    def __init__(self, config: Config, health: Health, queue: ChangeQueue, stop: threading.Event,
                 pipeline: Pipeline, store: StateStore, dumpflow: DumpFlow, reloader: Reloader,
                 confine: Confinement, watcher: TreeWatcher, alertmanager: AlertmanagerPusher | None,
                 on_transition: Callable[[Transition], None] | None, saves: SaveTracker,
                 on_alerts_changed: Callable[[Iterable[str]], None] | None = None) -> None:
        """``on_alerts_changed``: told the fingerprints of the alerts a step changed or dropped,
        outside the pipeline lock, as soon as the step is done (the API's alerts view)."""
        self.config = config
        self.health = health
        self.queue = queue
        self.stop = stop
        self.pipeline = pipeline
        self.store = store
        self.dumpflow = dumpflow
        self.dumps = dumpflow.scheduler
        self.reloader = reloader
        self.confine = confine
        self.watcher = watcher
        self.alertmanager = alertmanager
        self.on_transition = on_transition
        # the main worker always has work (its loop runs every evaluation_interval at least)
        self.beat = Heartbeat("worker", busy=True)
        self.follower = Follower(config, health, confine, self.beat, self._process, self.dumps.touched,
                                 queue.put, stop.is_set)
        self._expired: list[Labels] = []  # series to delete at the next commit
        self.saves = saves                # once-per-cause reports and the retry backoff of failed saves
        self._unsaved: set[str] = set()   # files read since the last commit that worked
        self.saved_at_exit = False        # the final commit at SIGTERM worked
        self.on_alerts_changed = on_alerts_changed
        self._last_read = float("-inf")   # monotonic start of the last pass that read changed paths
        self._catching_up = False         # a catch-up ran since the heap last gave memory back
        self._gave_back = float("-inf")   # monotonic time it last did

    def run(self) -> None:
        # Ready as soon as the watches are set up and the worker runs: catching up on a large
        # backlog can take minutes, and systemd must not time the start out meanwhile (the
        # progress is visible in precision_agent_log_lines_read_total).
        bind(self.beat)
        self.health.set("ready", 1)
        sd_notify(f"READY=1\nSTATUS=watching {len(self.config.watches)} path(s)")
        while not self.stop.is_set():
            batch = self._next_batch()
            self.beat.beat()
            try:
                if batch.reload_rules:
                    self.reloader.check_config()
                    self.reloader.reload_rules()
                paths = list(batch.paths)
                if batch.resync:
                    paths += self._resync()
                touched = self.follower.read(paths)
                self.dumps.due()
                for result in self.dumps.drain():
                    self._handle(result)
                now = time.time()
                self._expired.extend(self.pipeline.expire(now, self.config.series_ttl))
                self.pipeline.tick(now)
                self._pipeline_errors()
                self.emit_transitions()
                self._alerts_changed()
                if self.alertmanager is not None:
                    self.alertmanager.sync(list(self.pipeline.alerts.alerts.values()), now)
                self._commit(touched)
                self._give_back(touched)
            except Exception:  # never let one bad batch kill the agent
                log.exception("unexpected error in worker")
                self.health.error("internal", "unexpected error in worker (see traceback above)")
        self.saved_at_exit = self._commit(set(self.follower.streams), final=True)

    def _give_back(self, touched: set[str]) -> None:
        """After a catch-up (a backlog, or a pass over many files), once: the heap's free pages
        go back to the system (heap.py), or the idle agent keeps what the catch-up freed."""
        if self.follower.backlog or len(touched) >= CATCH_UP_FILES:
            self._catching_up = True
        elif self._catching_up and time.monotonic() - self._gave_back >= GIVE_BACK_EVERY_S:
            self._catching_up = False
            self._gave_back = time.monotonic()
            give_back()

    def _next_batch(self) -> Batch:
        """The next batch of changes, debounced from its leading edge (module docstring)."""
        # files still behind (readers/following.py): take what arrived meanwhile, do not wait
        wait = 0.0 if self.follower.backlog else self.config.evaluation_interval
        batch = self.queue.get(wait)
        if not batch.paths:
            return batch
        hold = self._last_read + self.config.debounce - time.monotonic()
        if hold > 0 and not self.stop.wait(hold):  # a burst: gather what comes until the window ends
            more = self.queue.get(0.0)
            batch = Batch(list(dict.fromkeys([*batch.paths, *more.paths])), batch.resync or more.resync,
                          batch.reload_rules or more.reload_rules)
        self._last_read = time.monotonic()
        return batch

    def _alerts_changed(self) -> None:
        book = self.pipeline.alerts
        if self.on_alerts_changed is not None and (book.dirty or book.deleted):
            self.on_alerts_changed(book.dirty | book.deleted)

    def _handle(self, result: ScanResult) -> None:
        """One scanned dump directory; a bug in one is reported and never costs the rest of the
        batch (already marked scanned: each would be missed until it changes again)."""
        try:
            self.dumpflow.handle(result)
        except Exception:
            log.exception("unexpected error handling the scan of %s", result.unit)
            self.health.error("internal", "unexpected error handling the scan of %s (see traceback above)",
                              result.unit)

    def _process(self, samples: list[Sample]) -> None:
        self.pipeline.process(samples)
        self._pipeline_errors()
        self._alerts_changed()  # a new page is on the API now, not after the pass's tick and commit

    def _pipeline_errors(self) -> None:
        for message in self.pipeline.errors:
            self.health.error("internal", "%s", message)
        self.pipeline.errors.clear()

    def _resync(self) -> list[str]:
        self.health.inc("resyncs")
        self.watcher.schedule_missing()
        self.reloader.check_rule_files()
        self.confine.refresh()
        # Every resync walks the trees: skipping walks while inotify looked healthy (every 4th
        # only) missed a root created after start (watched through its parent, not recursively), a
        # root replaced by a rename, subdirectories past the inotify limit and network mounts below
        # a local root for minutes. A walk of 10,000 files costs ~0.1 s of CPU.
        # a dump file: due() scans it only if it changed since its last scan
        return self.follower.resync(lambda f: self.dumps.touched(f, 0.0))

    def emit_transitions(self) -> None:
        for t in self.pipeline.alerts.drain_transitions():
            a = t.alert
            if t.new == AlertState.FIRING:
                log.warning("alert %s FIRING %s: %s", a.rule, dict(a.labels), a.annotations.get("summary", ""))
            elif t.new == AlertState.RESOLVED:
                log.info("alert %s resolved %s", a.rule, dict(a.labels))
            if self.on_transition is not None:
                self.on_transition(t)

    def _commit(self, touched: set[str], final: bool = False) -> bool:
        """Save what changed; False when it could not be saved. While saves fail (disk full), what
        is unsaved stays pending and the next try waits for the backoff (store/saving.py)."""
        touched = self._unsaved | touched
        now = time.time()
        if not final and not self.saves.due(now):
            self._unsaved = touched
            return False
        offsets = self.follower.positions(touched)
        memory = self.pipeline.memory_delta()  # detector memory: same transaction as offsets and alerts
        self.memory_errors()
        forget = self.follower.forget
        changes = self.pipeline.state_changes()
        origins = self.dumpflow.unsaved_origins()
        if not (offsets or changes or forget or self._expired or memory or self.store.pending
                or origins is not None or self.saves.cause is not None):
            return True
        try:
            self.store.commit(offsets=offsets, alerts=changes.alerts, deleted_alerts=changes.deleted_alerts,
                              series=changes.series, forget_offsets=forget, forget_series=self._expired,
                              memory=memory, dump_origins=origins)
        except StateError as exc:
            self.pipeline.memory.requeue(memory)
            self.pipeline.dirty_series.update(s.labels for s in changes.series)  # written by the next try
            self._unsaved = touched
            self.saves.failed(exc, now)
            return False
        self._unsaved = set()
        if origins is not None:
            self.dumpflow.origins_unsaved = False
        self.saves.succeeded()
        self.follower.committed(offsets)
        self._expired.clear()
        self.pipeline.alerts.committed()
        self.health.set("last_commit_timestamp_seconds", time.time())
        return True

    # -- state at start --------------------------------------------------------------------------
    def load_state(self) -> None:
        if self.store.unavailable is not None:  # the disk is full: start anyway, from what is readable
            self.saves.failed(self.store.unavailable, time.time(), "open the state store for writing")
        self.follower.offsets = self.store.load_offsets()
        for unit, (_dev, _ino, _size, _mtime, status) in self.store.load_scanned().items():
            try:
                self.dumps.scanned[unit] = tuple(int(x) for x in status.split(","))
            except ValueError:
                continue
        alerts = self.store.load_alerts()
        self.pipeline.alerts.load(alerts)
        for st in self.store.load_series():
            self.pipeline.series[st.labels] = st
        log.info("state: %d offset(s), %d alert(s), %d series from %s", len(self.follower.offsets), len(alerts),
                 len(self.pipeline.series), self.store.path)

    def restore_memory(self) -> None:
        try:
            rows = self.store.load_memory()
        except StateError as exc:
            self.health.error("state", "could not read detector memory (rules start empty): %s", exc)
            rows = []
        self.pipeline.restore_memory(rows, time.time())
        for row, reason in self.pipeline.memory.bad_rows:
            self.store.quarantine("memory", row, reason, "; its rule starts with empty memory, its alerts are kept")
        self.pipeline.memory.bad_rows.clear()
        for table, n in self.store.quarantined.items():
            self.health.inc_labelled("state_rows_quarantined", table, n)
        self.memory_errors()
        self.emit_transitions()  # alerts of rules whose memory could not be kept resolve now
        log.info("state: detector memory of %d series-rule pair(s) restored", len(rows))

    def memory_errors(self) -> None:
        for message in self.pipeline.memory.errors:
            self.health.error("state", "%s", message)
        self.pipeline.memory.errors.clear()
