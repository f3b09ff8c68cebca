"""The resident agent: wires sources → readers → pipeline → state store → exporters, and runs
their lifecycle (start, signals, health checks, shutdown).

Threads: watchdog's observer and the apscheduler jobs only *enqueue* work; one worker thread
(worker.py) owns the readers, the pipeline and the state store, so detection needs no locks; the
HTTP server reads snapshots. SIGTERM finishes the current batch, commits and exits 0; SIGHUP
reloads the rule files (a bad file keeps its last good version) and re-reads the config file
(reload.py): a bad one is an error that keeps the running configuration, and changed settings
are named in the log and in ``precision_agent_config_restart_needed``, since they take effect at
the next restart.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Callable

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry, ProcessCollector

from .. import __version__
from ..config import Config, Watch, split_listen
from ..dumps.results import DumpBook
from ..engine.alerts import Transition
from ..engine.pipeline import Pipeline
from ..engine.rulefile import RuleSet
from ..exporters.alertmanager import AlertmanagerCollector, AlertmanagerPusher
from ..exporters.api import AlertsView, status_json
from ..exporters.dumps import DumpCollector
from ..exporters.http import HttpCollector, HttpExporter
from ..exporters.httpserver import ServerLimits
from ..exporters.metrics import AgentCollector
from ..exporters.webconfig import load_web_config
from ..health import Health
from ..readers.logstream import LogStream
from ..sources.confine import Confinement
from ..sources.queue import ChangeQueue
from ..sources.watcher import TreeWatcher
from ..store.book import MemoryBook
from ..store.saving import SaveTracker
from ..store.state import StateStore
from .dumpflow import DumpFlow
from .fdlimit import plan_descriptors
from .priority import lower_priority
from .reload import Reloader
from .systemd import sd_notify, watchdog_interval
from .worker import Worker

log = logging.getLogger("precision_agent")


class Agent:
    def __init__(self, config: Config, on_transition: Callable[[Transition], None] | None = None,
                 reread: Callable[[], Config] | None = None) -> None:
        """``reread``: loads and validates the config file again (SIGHUP), as at start."""
        self.config = config
        self.health = Health()
        self.health.stall_timeout = config.limits.worker_stall_timeout
        self.queue = ChangeQueue(config.limits.queue_size)
        self.stop_event = threading.Event()
        self.store = StateStore(config.state_dir, lambda msg: self.health.error("state", "%s", msg))
        self.saves = SaveTracker(self.health, self.store.path, config.limits.state_save_retry_max)  # reported once, retried
        self.pipeline = Pipeline(RuleSet(), max_series=config.limits.max_series, memory=MemoryBook())
        self.pipeline.suspects.window = config.suspect_window
        self.dump_book = DumpBook()
        self.dumpflow = DumpFlow(config, self.health, self.pipeline, self.store, self.dump_book, self.saves)
        self.dumpflow.restore()
        self.dumps = self.dumpflow.scheduler
        # symlinks out of the watched roots are not followed (sources/confine.py)
        self.confine = Confinement(config.watches, lambda path: self.health.inc("symlinks_skipped"))
        self.dumps.guard = self.confine.guard
        self._stalled: set[str] = set()   # workers whose stall was reported
        self._thread: threading.Thread | None = None
        # one job thread: the jobs only enqueue work or read a few numbers, and apscheduler's
        # default pool would add up to 10 threads (daemon/threads.py counts them)
        self.scheduler = BackgroundScheduler(timezone="UTC", executors={"default": ThreadPoolExecutor(1)}, job_defaults={
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
        self.fds = plan_descriptors(config)  # fit RLIMIT_NOFILE now, not with EMFILE storms later
        limits = ServerLimits(self.fds.max_connections, h.workers, h.header_timeout, h.idle_timeout, h.write_timeout,
                              h.max_header_bytes)
        self.alerts_view = AlertsView(self.pipeline)  # /api/v1/alerts, rendered once per change
        self.http = HttpExporter(host, port, self.registry, self.alerts_view.body,
                                 lambda: status_json(self.health, self.pipeline, self.streams, config.watches,
                                                     self.watcher.modes, self.worker.follower.yields.verdicts(),
                                                     self.worker.follower.unread),
                                 self.is_ready,
                                 {"/api/v1/compare": self.dump_book.results}, limits, web)
        self.registry.register(HttpCollector(self.http))
        self.alertmanager: AlertmanagerPusher | None = None
        if config.alertmanager is not None:
            self.alertmanager = AlertmanagerPusher(
                config.alertmanager, instance=socket.gethostname(), generator_url=self.http.url,
                on_error=lambda msg: self.health.error("notify", "%s", msg))
            self.registry.register(AlertmanagerCollector(self.alertmanager))
        self.reloader = Reloader(config, self.health, self.pipeline, self.http, reread)
        self.worker = Worker(config, self.health, self.queue, self.stop_event, self.pipeline, self.store,
                             self.dumpflow, self.reloader, self.confine, self.watcher, self.alertmanager,
                             on_transition, self.saves, self.alerts_view.changed)
        self.worker.follower.max_open_files = self.fds.max_open_files
        self.health.set("max_open_files", self.fds.max_open_files)
        self.health.set("max_open_files_lowered", float(self.fds.lowered))
        self.health.add_worker("worker", lambda: [self.worker.beat])
        self.health.add_worker("dump-scan", self.dumps.heartbeats)

    @property
    def streams(self) -> dict[str, LogStream]:
        """The followed log files (readers/following.py)."""
        return self.worker.follower.streams

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        lower_priority(self.config.limits.nice, self.config.limits.io_idle)  # before threads start
        for w in self.config.watches:
            if not w.path.exists():
                log.warning("%s does not exist yet; it will be picked up when it appears", w.path)
        self.worker.load_state()
        self.reloader.reload_rules(initial=True)
        self.worker.restore_memory()  # after the rules: memory belongs to the rules in force
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
        self._thread = threading.Thread(target=self.worker.run, name="worker", daemon=True)
        self._thread.start()
        self.dumps.start()
        self.queue.request_resync()  # first pass: catch up with everything already on disk

    def run_forever(self) -> int:
        """Run until SIGTERM/SIGINT; SIGHUP reloads rules. Returns the exit status."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGHUP, lambda *_: self.queue.request_reload())
        self.start()
        while not self.stop_event.wait(0.5):
            if self._thread is not None and not self._thread.is_alive():
                log.error("worker thread died; exiting so the service manager restarts the agent")
                self.shutdown()
                return 1
        return 0 if self.shutdown() else 1

    def shutdown(self) -> bool:
        """Stop everything; True when the final state save worked (else the exit status is 1)."""
        try:
            self.scheduler.shutdown(wait=False)  # no watchdog pings after STOPPING
        except Exception:  # scheduler not started
            pass
        sd_notify("STOPPING=1")
        log.info("stopping")
        self.stop_event.set()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.alertmanager is not None:
            self.alertmanager.stop()
        self.dumps.stop(timeout=5)  # a scan in progress is cancelled at its next chunk
        self.watcher.stop()
        self.http.stop()
        self.worker.follower.close()
        self.store.close()
        if self.worker.saved_at_exit:
            log.info("stopped; state saved in %s", self.store.path)
            return True
        log.error("stopped; state NOT saved in %s (%s): the next start resumes from the last save that "
                  "worked, and may read some log lines again", self.store.path, self.saves.cause or "no final save")
        return False

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


def default_state_dir() -> Path:
    """Where state goes when none was configured and the system default is not writable."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "precision-agent"


__all__ = ["Agent", "Watch"]
