"""Following log files: which files are open, where each one was read to, rotation, deletion,
and the bound on open descriptors. The daemon's worker calls ``resync`` (what may have changed,
from the file system itself) and ``read`` (read what changed, within a byte budget per file);
the samples go to ``sink``. Offsets here are the last *committed* positions."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from typing import Callable, Iterable

from ..config import Config
from ..health import Health, Heartbeat
from ..model import Sample
from ..sources.confine import Confinement
from ..sources.watcher import walk, watch_for
from .filecursor import MetricFileStream
from .logstream import LogStream
from .parsers import UnknownFormat
from .faultcodes import current_codes
from .metricmap import current_map
from .runs import run_labels
from .streams import open_stream
from .tailer import TailEvent, TailPosition
from .yields import YieldWatch

log = logging.getLogger("precision_agent")

# One read() reads for at most this long, then hands back to the worker (rules tick, state commit,
# fresh file events first): a catch-up over 10,000 files or a 200 MB line goes on in the next one.
PASS_SECONDS = 0.5


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
        self._gone_open: dict[str, None] = {}  # those of them holding a descriptor (max_open_files)
        lim = config.limits  # files that grow but yield no record: the agent says it is blind
        self.yields = YieldWatch(lim.unrecognized_lines, lim.unrecognized_after, lim.unrecognized_min_lines)
        self._internal_errors: set[tuple[str, str, str]] = set()  # (path, cause) said once
        self._map_errors: set[str] = set()  # $PRECISION_AGENT_METRIC_MAP errors already reported
        # descriptors held at most (the daemon may lower it to fit RLIMIT_NOFILE: daemon/fdlimit.py)
        self.max_open_files = config.limits.max_open_files
        self.unread: dict[str, int] = {}  # path -> bytes written but not read yet (the backlog; > 0 only)
        self._check_fd = confine.check_fd  # one bound method for every tailer, not one each
        self.backlog: dict[str, None] = {}  # paths to read at the next read(), after the fresh ones
        self._again: deque[str] = deque()  # files with more to read, for another turn in this read()
        self._first: deque[str] = deque()  # deleted files over the descriptor budget: drained first

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
                if stream is None:
                    self.unread.pop(path, None)  # never opened (max_files, or not yet): nothing left to read
                elif path not in self._gone:
                    # gone: the open descriptor still holds the rest; read it to its end (a budget
                    # per pass, like any file) and only then forget the file (in read)
                    self._gone.add(path)
                    if stream.is_open:  # it still counts against max_open_files
                        self._open_lru.pop(path, None)
                        self._gone_open[path] = None
                    changed.append(path)
                continue
            pos = stream.position if stream is not None else None
            if pos is not None and (st.st_dev, st.st_ino) == (pos.dev, pos.ino) and st.st_size == pos.offset:
                self.unread.pop(path, None)
                continue  # unchanged since we read it: no need to open it again
            if stream is None or not stream.is_open:  # (an open one is measured as it is read)
                same = pos is not None and (st.st_dev, st.st_ino) == (pos.dev, pos.ino)
                self._set_unread(path, st.st_size - (pos.offset if same else 0))
            changed.append(path)
        for path in [p for p in self.unread if p not in candidates]:
            self.unread.pop(path)  # gone before it was opened (or refused by max_files): no backlog
        self._publish_backlog()
        return changed

    def read(self, paths: Iterable[str]) -> set[str]:
        """Read each path's new lines (a budget per turn), then the backlog of earlier passes, until
        PASS_SECONDS are spent (what is left becomes the backlog). A file with more to read gets
        every other turn until it has caught up (one file behind by 200 MB is read at once, not
        after each of 10,000 others had theirs; two such files share). Returns the paths whose
        position moved."""
        paths = dict.fromkeys([*paths, *self.backlog])
        if self._gone_open and self._over_budget(opening=True):  # deleted files first: read out, their descriptors go
            paths = dict.fromkeys([*(p for p in paths if p in self._gone_open), *paths])
        order, again, first = deque(paths), self._again, self._first
        again.clear()
        first.clear()
        self.backlog = {}
        deadline = time.monotonic() + PASS_SECONDS
        touched: set[str] = set()
        turn = 0
        while order or again or first:
            if self.stopping():
                break
            if turn and time.monotonic() > deadline:
                self.backlog = dict.fromkeys([*first, *again, *order])  # behind files first next time
                break
            turn += 1
            if first:
                path = first.popleft()
            else:
                path = again.popleft() if again and (turn % 2 or not order) else order.popleft()
            self.beat.beat()  # a long catch-up pass is progress, not a hang
            if path not in self.streams and (w := watch_for(self.config.watches, path)) is not None \
                    and w.kind == "dump":
                self.on_dump(path)
                continue
            try:
                self._read_one(path, touched)
            except Exception as exc:  # noqa: BLE001 - one reader's bug must not end the pass for every file
                self._internal(path, exc)
        self.health.set("watched_log_files", len(self.streams))
        self.health.set("log_files_unrecognized", self.yields.blind)
        self._publish_backlog()
        return touched

    def _internal(self, path: str, exc: Exception) -> None:
        """A bug in reading one file: said once per file and cause, and the pass goes on."""
        key = (path, type(exc).__name__, str(exc))
        if key not in self._internal_errors:
            if len(self._internal_errors) > 10000:
                self._internal_errors.clear()
            self._internal_errors.add(key)
            log.exception("internal error reading %s (the other files go on)", path)
            self.health.error("internal", "reading %s: %s: %s", path, type(exc).__name__, exc, logged=False)

    def _read_one(self, path: str, touched: set[str]) -> None:
        """One turn of one file (see read)."""
        stream = self.streams.get(path) or self._open(path)
        if stream is None:
            return
        before = stream.stats.lines, stream.stats.bytes, stream.stats.records, stream.stats.truncated_lines, \
            stream.stats.skipped
        consumed = stream.tailer.consumed_bytes
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
        self._schedule(path, stream.tailer.consumed_bytes - consumed)
        if path in self._gone and not os.path.lexists(path):
            if stream.tailer.unread_bytes() == 0:
                self._drop(path)
                touched.discard(path)
                log.info("%s is gone and was read to its end; stopped following it", path)
            else:
                self.requeue(path)
        else:
            self._gone.discard(path)  # it came back (a new file under the same name)
            self._gone_open.pop(path, None)
        self._limit_open_files(path)

    def _schedule(self, path: str, consumed: int) -> None:
        """Give a file that has more to read another turn (see read): whether the turn spent its
        budget or went into the cut part of an over-long line (no line came out, yet the bytes are
        behind us), a file with unread bytes stays scheduled until it has caught up. No progress
        at all (an error) waits for the next event or resync instead of spinning."""
        stream = self.streams[path]
        unread = stream.tailer.unread_bytes()
        self._set_unread(path, unread)
        if consumed >= self.config.limits.read_budget_bytes or (consumed > 0 and unread > 0):
            if path in self._gone_open and self._over_budget(opening=True):
                self._first.append(path)  # read it out: its descriptor is beyond max_open_files
            else:
                self._again.append(path)

    def _set_unread(self, path: str, n: int) -> None:
        """Only files behind have an entry: 10,000 idle files hold none."""
        if n > 0:
            self.unread[path] = n
        else:
            self.unread.pop(path, None)

    def _publish_backlog(self) -> None:
        self.health.set("log_unread_bytes", sum(self.unread.values()))
        self.health.set("log_files_behind", sum(1 for n in self.unread.values() if n > 0))
        self.health.set("log_files_open", len(self._open_lru) + len(self._gone_open))

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
        parser = getattr(stream, "parser", None)
        if parser is not None and parser.sparse:  # a kernel log: its faults are rare, by nature
            return
        st = stream.stats
        verdicts = self.yields.update(path, stream.base_labels, st.lines - getattr(st, "chatter", 0), st.records,
                                      time.time(), getattr(stream, "sample_lines", list))
        if verdicts:
            self.sink(verdicts)

    def _drop(self, path: str) -> None:
        if verdicts := self.yields.forget(path, time.time()):
            self.sink(verdicts)
        self._gone.discard(path)
        self._gone_open.pop(path, None)
        stream = self.streams.pop(path)
        stream.close()
        self._open_lru.pop(path, None)
        self.unread.pop(path, None)
        self.offsets.pop(path, None)
        self.forget.add(path)

    def _limit_open_files(self, just_read: str) -> None:
        """After each file read (not after a pass: a first pass over 10,000 files must not hold
        10,000 descriptors), close the least recently read ones beyond max_open_files, so the
        hottest files stay open; a closed tailer keeps its position and reopens (checking the
        inode) on its next read. A deleted file's descriptor counts too but is never closed (that
        would lose what is left): it is read out first while over the budget (see read)."""
        lru = self._open_lru
        stream = self.streams.get(just_read)
        lru.pop(just_read, None)
        if stream is not None and stream.is_open:
            if just_read not in self._gone:
                lru[just_read] = None  # most recently read last
        else:
            self._gone_open.pop(just_read, None)
        while lru and self._over_budget():
            path, _ = lru.popitem(last=False)
            if (closing := self.streams.get(path)) is not None:
                closing.close()  # (a text log keeps less while it idles: logstream.py)
                if (pos := closing.position) is not None and pos == self.offsets.get(path):
                    self.offsets[path] = pos  # an idle file holds one position object, not two equal ones

    def _over_budget(self, opening: bool = False) -> bool:
        """More descriptors held than max_open_files (``opening``: no room for one more)."""
        return len(self._open_lru) + len(self._gone_open) + opening > self.max_open_files

    def _open(self, path: str) -> LogStream | MetricFileStream | None:
        watch = watch_for(self.config.watches, path)
        if not os.path.isfile(path):
            self.unread.pop(path, None)  # gone before it was opened: no backlog left behind
            self._refused.discard(path)
            return None
        if watch is None or watch.kind != "log" or not self.confine.allows(path):
            return None
        if len(self.streams) >= self.config.limits.max_files:
            if path not in self._refused:  # say it once per file, not at every event
                self._refused.add(path)
                self.health.error("watch", "not following %s: limits.max_files=%d reached", path,
                                  self.config.limits.max_files)
            return None
        labels = run_labels(path, watch.run_from, dict(watch.labels), str(watch.path))
        try:
            stream = open_stream(path, labels, watch.format, self.offsets.get(path),
                                 start_at_end=watch.start_at_end and path not in self.offsets,
                                 max_line_bytes=self.config.limits.max_line_bytes,
                                 chunk_bytes=self.config.limits.read_chunk_bytes, pattern=watch.pattern,
                                 check_open=self._check_fd)
        except UnknownFormat as exc:
            self.health.error("config", "%s: %s", path, exc)
            return None
        self.streams[path] = stream
        if isinstance(stream, MetricFileStream) and (why := current_map()[1]) and why not in self._map_errors:
            self._map_errors.add(why)  # once per error, not per file: the shipped map stays in force
            self.health.error("config", "metric map: %s", why)
        if isinstance(stream, LogStream) and (why := current_codes()[1]) and why not in self._map_errors:
            self._map_errors.add(why)  # the same for the fault-code catalogue the kernel format reads
            self.health.error("config", "fault codes: %s", why)
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
