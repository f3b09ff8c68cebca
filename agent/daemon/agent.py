"""The resident agent: wires sources → readers → pipeline → state store → exporters.

Threads: watchdog's observer and the apscheduler jobs only *enqueue* work; one worker thread
owns the readers, the pipeline and the state store, so detection needs no locks; the HTTP
server reads snapshots. SIGTERM finishes the current batch, commits and exits 0; SIGHUP reloads
the rule files (a bad file keeps its last good version) and re-reads the config file: a bad one
is an error that keeps the running configuration, and changed settings are named in the log and
in ``precision_agent_config_restart_needed``, since they take effect at the next restart.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry, ProcessCollector

from .. import __version__
from ..engine.alerts import Transition
from ..config import Config, ConfigError, Watch, split_listen
from ..health import Health, Heartbeat, bind
from ..model import AlertState
from .systemd import sd_notify, watchdog_interval
from ..engine.pipeline import Pipeline
from .priority import lower_priority
from ..readers.logstream import LogStream
from ..readers.runs import run_labels
from ..readers.parsers import UnknownFormat
from ..readers.tailer import TailEvent, TailPosition
from ..engine.rulefile import RuleSet, default_rules_dir, load_rules
from ..sources.confine import Confinement
from ..sources.queue import ChangeQueue
from ..sources.watcher import TreeWatcher, walk, watch_for
from .dumpflow import DumpFlow
from ..store.state import StateError, StateStore
from ..exporters.api import alerts_json, status_json
from ..exporters.http import HttpCollector, HttpExporter
from ..exporters.httpserver import ServerLimits
from ..exporters.webconfig import load_web_config
from ..exporters.alertmanager import AlertmanagerCollector, AlertmanagerPusher
from ..exporters.dumps import DumpBook, DumpCollector
from ..exporters.metrics import AgentCollector

log = logging.getLogger("precision_agent")


class Agent:
    def __init__(self, config: Config, on_transition: Callable[[Transition], None] | None = None,
                 reread: Callable[[], Config] | None = None) -> None:
        """``reread``: loads and validates the config file again (SIGHUP), as at start."""
        self.config = config
        self.reread = reread
        self.health = Health()
        self.health.stall_timeout = config.limits.worker_stall_timeout
        self.on_transition = on_transition
        self.queue = ChangeQueue(config.limits.queue_size)
        self.stop_event = threading.Event()
        self.streams: dict[str, LogStream] = {}
        self.offsets: dict[str, TailPosition] = {}
        self.rule_dirs = ([default_rules_dir()] if config.default_rules else []) + list(config.rule_dirs)
        self.store = StateStore(config.state_dir, lambda msg: self.health.error("state", "%s", msg))
        self.pipeline = Pipeline(RuleSet(), max_series=config.limits.max_series)
        self.dump_book = DumpBook()
        self.dumpflow = DumpFlow(config, self.health, self.pipeline, self.store, self.dump_book)
        self.dumps = self.dumpflow.scheduler
        # symlinks out of the watched roots are not followed (sources/confine.py)
        self.confine = Confinement(config.watches, lambda path: self.health.inc("symlinks_skipped"))
        self.dumps.guard = self.confine.guard
        self._rule_mtimes: dict[str, float] = {}
        self._forget: set[str] = set()  # offsets to delete at the next commit
        self._open_lru: OrderedDict[str, None] = OrderedDict()  # streams holding a descriptor
        self._refused: set[str] = set()  # files not followed because of limits.max_files
        self._gone: set[str] = set()      # deleted files still read through their open descriptor
        self._expired: list = []          # series to delete at the next commit
        # the main worker always has work (its loop runs every evaluation_interval at least)
        self.work_beat = Heartbeat("worker", busy=True)
        self.health.add_worker("worker", lambda: [self.work_beat])
        self.health.add_worker("dump-scan", self.dumps.heartbeats)
        self._stalled: set[str] = set()   # workers whose stall was reported
        self._worker: threading.Thread | None = None
        self.scheduler = BackgroundScheduler(timezone="UTC", job_defaults={
            "coalesce": True, "max_instances": 1, "misfire_grace_time": 30})
        self.watcher = TreeWatcher(config.watches, self._on_path, self._on_overflow,
                                   lambda msg: self.health.error("watch", "%s", msg))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AgentCollector(self.health, self.pipeline))
        self.registry.register(DumpCollector(self.dump_book))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes
        host, port = split_listen(config.listen)
        web = load_web_config(config.web_config_file) if config.web_config_file is not None else None
        h = config.http
        limits = ServerLimits(h.max_connections, h.workers, h.header_timeout, h.idle_timeout, h.write_timeout,
                              h.max_header_bytes)
        self.http = HttpExporter(host, port, self.registry, lambda: alerts_json(self.pipeline),
                                 lambda: status_json(self),
                                 self.is_ready,
                                 {"/api/v1/compare": self.dump_book.results}, limits, web)
        self.registry.register(HttpCollector(self.http))
        self.alertmanager: AlertmanagerPusher | None = None
        if config.alertmanager is not None:
            self.alertmanager = AlertmanagerPusher(
                config.alertmanager, instance=socket.gethostname(), generator_url=self.http.url,
                on_error=lambda msg: self.health.error("notify", "%s", msg))
            self.registry.register(AlertmanagerCollector(self.alertmanager))

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        lower_priority(self.config.limits.nice, self.config.limits.io_idle)  # before threads start
        for w in self.config.watches:
            if not w.path.exists():
                log.warning("%s does not exist yet; it will be picked up when it appears", w.path)
        self._load_state()
        self.reload_rules(initial=True)
        self._restore_memory()  # after the rules: memory belongs to the rules in force
        self.http.start()
        log.info("precision-agent %s listening on %s (metrics at %s/metrics)", __version__, self.http.url,
                 self.http.url)
        self.watcher.start()
        self.scheduler.add_job(self.queue.request_resync, "interval", seconds=self.config.resync_interval,
                               id="resync")
        self.scheduler.add_job(self._check_workers, "interval",
                               seconds=max(0.2, min(5.0, self.health.stall_timeout / 4)), id="stall-check")
        ping = watchdog_interval()
        if ping:
            self.scheduler.add_job(self._watchdog_ping, "interval", seconds=ping, id="watchdog")
        self.scheduler.start()
        if self.alertmanager is not None:
            self.alertmanager.start()
        self._worker = threading.Thread(target=self._work, name="worker", daemon=True)
        self._worker.start()
        self.dumps.start()
        self.queue.request_resync()  # first pass: catch up with everything already on disk

    def run_forever(self) -> int:
        """Run until SIGTERM/SIGINT; SIGHUP reloads rules. Returns the exit status."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGHUP, lambda *_: self.queue.request_reload())
        self.start()
        while not self.stop_event.wait(0.5):
            if self._worker is not None and not self._worker.is_alive():
                log.error("worker thread died; exiting so the service manager restarts the agent")
                self.shutdown()
                return 1
        self.shutdown()
        return 0

    def shutdown(self) -> None:
        try:
            self.scheduler.shutdown(wait=False)  # no watchdog pings after STOPPING
        except Exception:  # scheduler not started
            pass
        sd_notify("STOPPING=1")
        log.info("stopping")
        self.stop_event.set()
        self.queue.wake()
        if self._worker is not None:
            self._worker.join(timeout=30)
        if self.alertmanager is not None:
            self.alertmanager.stop()
        self.dumps.stop(timeout=5)  # a scan in progress is cancelled at its next chunk
        self.watcher.stop()
        self.http.stop()
        for s in self.streams.values():
            s.close()
        self.store.close()
        log.info("stopped; state saved in %s", self.store.path)

    # -- sources → queue -----------------------------------------------------------------------
    def _on_path(self, path: str) -> None:
        self.health.inc("watch_events")
        if not self.queue.put(path):
            self.health.inc("queue_overflows")

    def _on_overflow(self) -> None:
        self.queue.request_resync()

    def is_ready(self) -> bool:
        """/-/ready: watching, and no worker stalled (busy without progress for the stall timeout)."""
        return bool(self.health.gauges["ready"]) and not self.health.stalled_workers()

    def _watchdog_ping(self) -> None:
        # Only claim liveness when every worker is really making progress.
        if not self.health.stalled_workers():
            sd_notify("WATCHDOG=1")

    def _check_workers(self) -> None:
        """Scheduler thread: report a stalled worker once per stall, and let a fresh scan thread
        take over the dump queue from a stuck one (its own error line)."""
        self.dumps.check_stalled(self.health.stall_timeout)
        stalled = set(self.health.stalled_workers())
        for name in sorted(stalled - self._stalled):
            if name == "worker":
                self.health.error("internal", "worker: no progress for %.0f s; /-/ready says 503 and the "
                                  "systemd watchdog is no longer fed", self.health.stall_timeout)
            else:
                log.error("%s: stalled (no progress for %.0f s); /-/ready says 503 and the systemd watchdog is "
                          "no longer fed until it moves again", name, self.health.stall_timeout)
        for name in sorted(self._stalled - stalled):
            log.warning("%s: making progress again", name)
        self._stalled = stalled

    # -- the worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        # Ready as soon as the watches are set up and the worker runs: catching up on a large
        # backlog can take minutes, and systemd must not time the start out meanwhile (the
        # progress is visible in precision_agent_log_lines_read_total).
        bind(self.work_beat)
        self.health.set("ready", 1)
        sd_notify(f"READY=1\nSTATUS=watching {len(self.config.watches)} path(s)")
        while not self.stop_event.is_set():
            batch = self.queue.get(self.config.evaluation_interval, self.config.debounce)
            self.work_beat.beat()
            try:
                if batch.reload_rules:
                    self.check_config()
                    self.reload_rules()
                paths = list(batch.paths)
                if batch.resync:
                    paths += self._resync()
                touched = self._read(dict.fromkeys(paths))
                self.dumps.due()
                for result in self.dumps.drain():
                    self.dumpflow.handle(result)
                now = time.time()
                self._expired.extend(self.pipeline.expire(now, self.config.series_ttl))
                self.pipeline.tick(now)
                self._emit_transitions()
                if self.alertmanager is not None:
                    self.alertmanager.sync(list(self.pipeline.alerts.alerts.values()), now)
                self._commit(touched)
            except Exception:  # never let one bad batch kill the agent
                log.exception("unexpected error in worker")
                self.health.error("internal", "unexpected error in worker (see traceback above)")
        self._commit(set(self.streams))

    def _resync(self) -> list[str]:
        """Paths that may have changed, derived from the file system itself: new files, and
        followed files whose inode or size differs from what was read (a missed event)."""
        self.health.inc("resyncs")
        self.watcher.schedule_missing()
        self._check_rule_files()
        self.confine.refresh()
        candidates: dict[str, None] = {}
        allow = self.confine.allows
        for w in self.config.watches:
            if w.kind == "log":
                candidates.update(dict.fromkeys(walk(w, self.config.limits.max_files, allow)))
            else:
                for f in walk(w, self.config.limits.max_files, allow):
                    self.dumps.touched(f, 0.0)  # due() scans it only if it changed since its last scan
        candidates.update(dict.fromkeys(self.streams))
        changed: list[str] = []
        for path in candidates:
            stream = self.streams.get(path)
            try:
                st = os.stat(path)
            except OSError:
                if stream is not None and path not in self._gone:
                    # gone: the open descriptor still holds the rest; read it to its end (a budget
                    # per pass, like any file) and only then forget the file (in _read)
                    self._gone.add(path)
                    changed.append(path)
                continue
            pos = stream.position if stream is not None else None
            if pos is not None and (st.st_dev, st.st_ino) == (pos.dev, pos.ino) and st.st_size == pos.offset:
                continue  # unchanged since we read it: no need to open it again
            changed.append(path)
        return changed

    def _drop_stream(self, path: str) -> None:
        self._gone.discard(path)
        stream = self.streams.pop(path)
        stream.close()
        self._open_lru.pop(path, None)
        self.offsets.pop(path, None)
        self._forget.add(path)

    def _read(self, paths: dict[str, None]) -> set[str]:
        touched: set[str] = set()
        for path in paths:
            if self.stop_event.is_set():
                break
            self.work_beat.beat()  # a long catch-up pass is progress, not a hang
            if path not in self.streams and (w := watch_for(self.config.watches, path)) is not None \
                    and w.kind == "dump":
                self.dumps.touched(path)
                continue
            stream = self.streams.get(path) or self._open(path)
            if stream is None:
                continue
            before = stream.stats.lines, stream.stats.bytes, stream.stats.records, stream.stats.truncated_lines
            samples = stream.poll(self.config.limits.read_budget_bytes)
            for event, message in stream.tailer.drain_events():
                self._tail_event(path, event, message)
            for message in stream.parser.errors:
                self.health.error("parse", "%s: %s", path, message)
            stream.parser.errors.clear()
            if samples:
                self.pipeline.process(samples)
            for message in self.pipeline.errors:
                self.health.error("internal", "%s", message)
            self.pipeline.errors.clear()
            st = stream.stats
            if st.lines != before[0]:
                self.health.inc("log_lines_read", st.lines - before[0])
                self.health.inc("log_bytes_read", st.bytes - before[1])
                self.health.inc("log_records_parsed", st.records - before[2])
                self.health.inc("log_lines_truncated", st.truncated_lines - before[3])
            if stream.position is not None and stream.position != self.offsets.get(path):
                touched.add(path)
                if st.bytes - before[1] >= self.config.limits.read_budget_bytes:
                    self.queue.put(path)  # more to read: come back after the others had a turn
            if path in self._gone and not os.path.lexists(path):
                if stream.tailer.unread_bytes() == 0:
                    self._drop_stream(path)
                    touched.discard(path)
                    log.info("%s is gone and was read to its end; stopped following it", path)
                else:
                    self.queue.put(path)
            else:
                self._gone.discard(path)  # it came back (a new file under the same name)
        self._limit_open_files(paths)
        self.health.set("watched_log_files", len(self.streams))
        return touched

    def _limit_open_files(self, just_read: dict[str, None]) -> None:
        """Close the descriptors of the least recently read files beyond limits.max_open_files;
        a closed tailer keeps its position and reopens (checking the inode) on its next read."""
        lru = self._open_lru
        for path in just_read:
            stream = self.streams.get(path)
            lru.pop(path, None)
            if stream is not None and stream.tailer.is_open and path not in self._gone:
                # (a deleted file keeps its descriptor: closing it would lose what is left)
                lru[path] = None  # most recently read last
        while len(lru) > self.config.limits.max_open_files:
            path, _ = lru.popitem(last=False)
            if path in self.streams:
                self.streams[path].tailer.close()

    def _open(self, path: str) -> LogStream | None:
        watch = watch_for(self.config.watches, path)
        if watch is None or watch.kind != "log" or not os.path.isfile(path) or not self.confine.allows(path):
            return None
        if len(self.streams) >= self.config.limits.max_files:
            if path not in self._refused:  # say it once per file, not at every event
                self._refused.add(path)
                self.health.error("watch", "not following %s: limits.max_files=%d reached", path,
                                  self.config.limits.max_files)
            return None
        labels = run_labels(path, watch.run_from, dict(watch.labels))
        try:
            stream = LogStream(path, labels, watch.format, self.offsets.get(path),
                               start_at_end=watch.start_at_end and path not in self.offsets,
                               max_line_bytes=self.config.limits.max_line_bytes,
                               chunk_bytes=self.config.limits.read_chunk_bytes, pattern=watch.pattern,
                               check_open=self.confine.check_fd)
        except UnknownFormat as exc:
            self.health.error("config", "%s: %s", path, exc)
            return None
        self.streams[path] = stream
        log.info("following %s", path)
        return stream

    def _tail_event(self, path: str, event: TailEvent, message: str) -> None:
        name = event.name
        if name == "ROTATED":
            self.health.inc("log_rotations")
        elif name == "TRUNCATED":
            self.health.inc("log_truncations")
        if name == "ERROR":
            self.health.error("read", "%s: %s", path, message)
        else:
            log.info("%s: %s", path, message)

    def _emit_transitions(self) -> None:
        for t in self.pipeline.alerts.drain_transitions():
            a = t.alert
            if t.new == AlertState.FIRING:
                log.warning("alert %s FIRING %s: %s", a.rule, dict(a.labels), a.annotations.get("summary", ""))
            elif t.new == AlertState.RESOLVED:
                log.info("alert %s resolved %s", a.rule, dict(a.labels))
            if self.on_transition is not None:
                self.on_transition(t)

    def _commit(self, touched: set[str]) -> None:
        book = self.pipeline.alerts
        offsets = {p: self.streams[p].position for p in touched if p in self.streams and self.streams[p].position}
        memory = self.pipeline.memory_delta()  # detector memory: same transaction as offsets and alerts
        self._memory_errors()
        if not (offsets or book.dirty or book.deleted or self.pipeline.dirty_series or self._forget
                or self._expired or memory):
            return
        with self.pipeline.lock:
            alerts = [book.alerts[f] for f in book.dirty if f in book.alerts]
            series = [self.pipeline.series[k] for k in self.pipeline.dirty_series if k in self.pipeline.series]
            self.pipeline.dirty_series.clear()
        try:
            self.store.commit(offsets=offsets, alerts=alerts, deleted_alerts=book.deleted, series=series,
                              forget_offsets=self._forget, forget_series=self._expired, memory=memory)
        except StateError as exc:
            self.pipeline.memory.requeue(memory)
            self.health.error("state", "could not save state (will retry): %s", exc)
            return
        self.offsets.update(offsets)
        self._forget.clear()
        self._expired.clear()
        book.dirty.clear()
        book.deleted.clear()
        self.health.set("last_commit_timestamp_seconds", time.time())

    # -- rules and state -------------------------------------------------------------------------
    def check_config(self) -> None:
        """SIGHUP: the config file again, validated as at start. The running configuration stays
        in force either way; what differs is reported, not half-applied."""
        if self.reread is None:
            return
        try:
            new = self.reread()
        except ConfigError as exc:
            self.health.error("config", "%s (keeping the running configuration)", exc)
            self.health.inc("config_reloads_failure")
            return
        self.health.inc("config_reloads_success")
        self._reload_web_config()
        changed = [f for f in type(self.config).model_fields if getattr(new, f) != getattr(self.config, f)]
        self.health.set("config_restart_needed", 1.0 if changed else 0.0)
        if changed:
            log.warning("the config file changed %s; the agent keeps its running configuration until it "
                        "restarts (SIGHUP reloads rule files only)", ", ".join(changed))

    def _reload_web_config(self) -> None:
        """SIGHUP reads the web config file again, as exporter-toolkit does on every request:
        rotated certificates and changed users apply without a restart."""
        path = self.config.web_config_file
        if path is None:
            return
        try:
            self.http.apply(load_web_config(path))
        except (ConfigError, ValueError) as exc:
            self.health.error("config", "web config file: %s (keeping the one in force)", exc)
            return
        log.info("web config file %s reloaded", path)

    def reload_rules(self, initial: bool = False) -> None:
        try:
            rules = load_rules(self.rule_dirs, None if initial else self.pipeline.rules,
                               self.config.runbook_base_url or "")
        except ConfigError as exc:  # e.g. a rule directory vanished: keep the rules in force
            self.health.error("rule_file", "%s (keeping the rules in force)", exc)
            self.health.inc("rule_reloads_failure")
            self._rule_mtimes = self._rule_file_mtimes()  # report once, not at every resync
            return
        for err in rules.errors.values():
            self.health.error("rule_file", "%s (keeping the last good version, if any)", err)
        self.health.inc("rule_reloads_failure" if rules.errors else "rule_reloads_success")
        self.pipeline.set_rules(rules)
        self.health.set("rule_files_ok", len(rules.by_file) - len([e for e in rules.errors if e in rules.by_file]))
        self.health.set("rule_files_error", len(rules.errors))
        self.health.set("rules_loaded", len(rules.rules))
        self._rule_mtimes = self._rule_file_mtimes()
        log.info("loaded %d rule(s) from %d file(s)", len(rules.rules), len(rules.by_file))

    def _rule_file_mtimes(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in self.rule_dirs:
            for p in ([d] if d.is_file() else sorted(d.glob("*.y*ml")) if d.is_dir() else []):
                try:
                    out[str(p)] = p.stat().st_mtime
                except OSError:
                    pass
        return out

    def _check_rule_files(self) -> None:
        if self._rule_file_mtimes() != self._rule_mtimes:
            log.info("rule files changed; reloading")
            self.reload_rules()

    def _restore_memory(self) -> None:
        try:
            rows = self.store.load_memory()
        except StateError as exc:
            self.health.error("state", "could not read detector memory (rules start empty): %s", exc)
            rows = []
        self.pipeline.restore_memory(rows, time.time())
        self._memory_errors()
        self._emit_transitions()  # alerts of rules whose memory could not be kept resolve now
        log.info("state: detector memory of %d series-rule pair(s) restored", len(rows))

    def _memory_errors(self) -> None:
        for message in self.pipeline.memory.errors:
            self.health.error("state", "%s", message)
        self.pipeline.memory.errors.clear()

    def _load_state(self) -> None:
        self.offsets = self.store.load_offsets()
        for unit, (_dev, _ino, _size, _mtime, status) in self.store.load_scanned().items():
            try:
                self.dumps.scanned[unit] = tuple(int(x) for x in status.split(","))
            except ValueError:
                continue
        alerts = self.store.load_alerts()
        self.pipeline.alerts.load(alerts)
        for st in self.store.load_series():
            self.pipeline.series[st.labels] = st
        log.info("state: %d offset(s), %d alert(s), %d series from %s", len(self.offsets), len(alerts),
                 len(self.pipeline.series), self.store.path)


def default_state_dir() -> Path:
    """Where state goes when none was configured and the system default is not writable."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "precision-agent"


__all__ = ["Agent", "Watch"]
