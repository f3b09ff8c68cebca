"""Following log files: which files are open, where each one was read to, rotation, deletion,
and the bound on open descriptors. The daemon's worker calls ``resync`` (what may have changed,
from the file system itself) and ``read`` (read what changed, within a byte budget per file);
the samples go to ``sink``. Offsets here are the last *committed* positions."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Callable, Iterable

from ..config import Config
from ..health import Health, Heartbeat
from ..model import Sample
from ..sources.confine import Confinement
from ..sources.watcher import walk, watch_for
from .filecursor import MetricFileStream
from .logstream import LogStream
from .parsers import UnknownFormat
from .metricmap import current_map
from .runs import run_labels
from .streams import open_stream
from .tailer import TailEvent, TailPosition
from .yields import YieldWatch

log = logging.getLogger("precision_agent")


class Follower:
    def __init__(self, config: Config, health: Health, confine: Confinement, beat: Heartbeat,
                 sink: Callable[[list[Sample]], None], on_dump: Callable[[str], None],
                 requeue: Callable[[str], object], stopping: Callable[[], bool]) -> None:
        """``sink``: takes the samples read; ``on_dump``: a path under a dump watch changed;
        ``requeue``: come back to this path later (more to read); ``stopping``: stop reading."""
        self.config = config
        self.health = health
        self.confine = confine
        self.beat = beat
        self.sink = sink
        self.on_dump = on_dump
        self.requeue = requeue
        self.stopping = stopping
        self.streams: dict[str, LogStream | MetricFileStream] = {}
        self.offsets: dict[str, TailPosition] = {}   # committed positions (state store)
        self.forget: set[str] = set()   # offsets to delete at the next commit
        self._open_lru: OrderedDict[str, None] = OrderedDict()  # streams holding a descriptor
        self._refused: set[str] = set()  # files not followed because of limits.max_files
        self._gone: set[str] = set()      # deleted files still read through their open descriptor
        lim = config.limits  # files that grow but yield no record: the agent says it is blind
        self.yields = YieldWatch(lim.unrecognized_lines, lim.unrecognized_after, lim.unrecognized_min_lines)
        self._map_errors: set[str] = set()  # $PRECISION_AGENT_METRIC_MAP errors already reported

    def resync(self, touch_dump: Callable[[str], None]) -> list[str]:
        """Paths that may have changed, derived from the file system itself: new files, and
        followed files whose inode or size differs from what was read (a missed event). Files
        under dump watches go to ``touch_dump``."""
        candidates: dict[str, None] = {}
        allow = self.confine.allows
        for w in self.config.watches:
            if w.kind == "log":
                candidates.update(dict.fromkeys(walk(w, self.config.limits.max_files, allow)))
            else:
                for f in walk(w, self.config.limits.max_files, allow):
                    touch_dump(f)
        candidates.update(dict.fromkeys(self.streams))
        changed: list[str] = []
        for path in candidates:
            stream = self.streams.get(path)
            try:
                st = os.stat(path)
            except OSError:
                if stream is not None and path not in self._gone:
                    # gone: the open descriptor still holds the rest; read it to its end (a budget
                    # per pass, like any file) and only then forget the file (in read)
                    self._gone.add(path)
                    changed.append(path)
                continue
            pos = stream.position if stream is not None else None
            if pos is not None and (st.st_dev, st.st_ino) == (pos.dev, pos.ino) and st.st_size == pos.offset:
                continue  # unchanged since we read it: no need to open it again
            changed.append(path)
        return changed

    def read(self, paths: Iterable[str]) -> set[str]:
        """Read each path's new lines (within the per-pass budget); the paths whose position moved."""
        paths = dict.fromkeys(paths)
        touched: set[str] = set()
        for path in paths:
            if self.stopping():
                break
            self.beat.beat()  # a long catch-up pass is progress, not a hang
            if path not in self.streams and (w := watch_for(self.config.watches, path)) is not None \
                    and w.kind == "dump":
                self.on_dump(path)
                continue
            stream = self.streams.get(path) or self._open(path)
            if stream is None:
                continue
            before = stream.stats.lines, stream.stats.bytes, stream.stats.records, stream.stats.truncated_lines, \
                stream.stats.skipped
            samples = stream.poll(self.config.limits.read_budget_bytes)
            for event, message in stream.tailer.drain_events():
                self._tail_event(path, event, message)
            for message in stream.parser.errors:
                self.health.error("parse", "%s: %s", path, message)
            stream.parser.errors.clear()
            if samples:
                self.sink(samples)
            st = stream.stats
            if st.lines != before[0]:
                self._judge_yield(path, stream)  # before the counters move: a verdict is never behind them
                self.health.inc("log_lines_read", st.lines - before[0])
                self.health.inc("log_bytes_read", st.bytes - before[1])
                self.health.inc("log_records_parsed", st.records - before[2])
                self.health.inc("log_lines_truncated", st.truncated_lines - before[3])
            if st.skipped != before[4]:
                self.health.inc("metric_records_skipped", st.skipped - before[4])
            if stream.position is not None and stream.position != self.offsets.get(path):
                touched.add(path)
                if st.bytes - before[1] >= self.config.limits.read_budget_bytes:
                    self.requeue(path)  # more to read: come back after the others had a turn
            if path in self._gone and not os.path.lexists(path):
                if stream.tailer.unread_bytes() == 0:
                    self._drop(path)
                    touched.discard(path)
                    log.info("%s is gone and was read to its end; stopped following it", path)
                else:
                    self.requeue(path)
            else:
                self._gone.discard(path)  # it came back (a new file under the same name)
        self._limit_open_files(paths)
        self.health.set("watched_log_files", len(self.streams))
        self.health.set("log_files_unrecognized", self.yields.blind)
        return touched

    def positions(self, paths: Iterable[str]) -> dict[str, TailPosition]:
        """The current positions of ``paths`` (for the next commit)."""
        return {p: pos for p in paths if p in self.streams and (pos := self.streams[p].position)}

    def committed(self, offsets: dict[str, TailPosition]) -> None:
        """The state store holds ``offsets`` and the forgotten files now."""
        self.offsets.update(offsets)
        self.forget.clear()

    def close(self) -> None:
        for s in self.streams.values():
            s.close()

    def _judge_yield(self, path: str, stream: LogStream) -> None:
        """Units read against records yielded (yields.py): a verdict sample when blind or fed again.
        Any reader takes part: its stats' ``lines`` (units) and ``records``, less its ``chatter``."""
        st = stream.stats
        verdicts = self.yields.update(path, stream.base_labels, st.lines - getattr(st, "chatter", 0), st.records,
                                      time.time(), getattr(stream, "sample_lines", list))
        if verdicts:
            self.sink(verdicts)

    def _drop(self, path: str) -> None:
        if verdicts := self.yields.forget(path, time.time()):
            self.sink(verdicts)
        self._gone.discard(path)
        stream = self.streams.pop(path)
        stream.close()
        self._open_lru.pop(path, None)
        self.offsets.pop(path, None)
        self.forget.add(path)

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

    def _open(self, path: str) -> LogStream | MetricFileStream | None:
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
            stream = open_stream(path, labels, watch.format, self.offsets.get(path),
                                 start_at_end=watch.start_at_end and path not in self.offsets,
                                 max_line_bytes=self.config.limits.max_line_bytes,
                                 chunk_bytes=self.config.limits.read_chunk_bytes, pattern=watch.pattern,
                                 check_open=self.confine.check_fd)
        except UnknownFormat as exc:
            self.health.error("config", "%s: %s", path, exc)
            return None
        self.streams[path] = stream
        if isinstance(stream, MetricFileStream) and (why := current_map()[1]) and why not in self._map_errors:
            self._map_errors.add(why)  # once per error, not per file: the shipped map stays in force
            self.health.error("config", "metric map: %s", why)
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
