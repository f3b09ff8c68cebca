"""File-system sources: one watchdog observer for all watches, plus the tree walk used by
the periodic resync. Sources only say *which* path changed; they never open or parse files.

inotify is treated as a hint (it loses events on queue overflow, and files written right after
``mkdir`` of a new directory are often missed), so the resync walk is the ground truth.

Watches on network or FUSE file systems (where inotify never sees another client's writes) are
polled instead (``poll``/``poll_interval`` on the watch; see mounts.py). Recursive inotify watches
cost one kernel watch per directory: a tree that would pass fs.inotify.max_user_watches is left
to the resync walk, with a warning that names the sysctl, rather than watched in part silently.
"""

from __future__ import annotations

import fnmatch
import logging
import operator
import os
import re
import warnings
from typing import Callable, Iterator

from watchdog.events import (DirCreatedEvent, DirDeletedEvent, DirMovedEvent, FileClosedEvent, FileCreatedEvent,
                             FileDeletedEvent, FileModifiedEvent, FileMovedEvent, FileSystemEvent,
                             FileSystemEventHandler)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch
from watchdog.observers.polling import PollingObserver

from ..config import Watch
from .mounts import Mount, count_dirs, is_network_fs, mount_of, read_mounts, read_watch_limit

log = logging.getLogger(__name__)
warnings.filterwarnings("ignore", category=RuntimeWarning, module="watchdog")
EVENT_FILTER = [FileCreatedEvent, FileModifiedEvent, FileClosedEvent, FileMovedEvent, FileDeletedEvent,
                DirCreatedEvent, DirMovedEvent, DirDeletedEvent]


_Match = Callable[[str], object]
_GLOBS: dict[int, tuple[Watch, _Match]] = {}


def _globs(watch: Watch) -> _Match:
    """The watch's globs as one compiled regex, as ``fnmatch.fnmatch`` reads a glob: a name
    matches when no exclude glob and some include glob does (a resync asks for every file of the
    tree: 10,000 of them were 13 ``fnmatch`` calls each). Kept per watch object (a frozen config
    model)."""
    got = _GLOBS.get(id(watch))
    if got is not None and got[0] is watch:
        return got[1]
    if len(_GLOBS) > 64:  # watches come from the config (and its reloads): a few
        _GLOBS.clear()
    exclude, include = ("|".join(fnmatch.translate(os.path.normcase(p)) for p in pats) or "(?!)"
                        for pats in (watch.exclude, watch.patterns))
    accept = re.compile(f"(?!{exclude})(?:{include})").match
    _GLOBS[id(watch)] = (watch, accept)
    return accept


def matches(watch: Watch, path: str) -> bool:
    """Whether a file path belongs to ``watch`` (its include/exclude globs on the file name)."""
    return _globs(watch)(os.path.normcase(os.path.basename(path))) is not None


def watch_for(watches: list[Watch], path: str) -> Watch | None:
    """The most specific watch covering ``path`` whose globs accept it."""
    best: Watch | None = None
    best_len = -1
    for w in watches:
        root = str(w.path)
        if w.path.is_file() or not os.path.isdir(root):
            ok = path == root
        else:
            parent = os.path.dirname(path)
            ok = (parent == root or (w.recursive and parent.startswith(root.rstrip("/") + "/"))) and matches(w, path)
        if ok and len(root) > best_len:
            best, best_len = w, len(root)
    return best


def walk(watch: Watch, limit: int, allow: Callable[[str], bool] | None = None) -> Iterator[str]:
    """Files of a watch, found by listing the tree (at most ``limit``); unreadable dirs skipped,
    symlinked dirs not entered, a symlinked file only if ``allow(path)`` (the confinement).
    The number of directories listed is left in DIRS_SEEN (the watch-limit check reuses it).

    Every resync lists every watched file (10,000 on a big host, every ``resync_interval``), so
    the per-entry work is kept small: the globs are looked up once per walk and matched on the
    entry's name, and the file type comes from the directory listing (no ``stat`` per file)."""
    root = str(watch.path)
    if not os.path.exists(root):  # the job may not have created it yet
        return
    if os.path.isfile(root):
        yield root
        return
    accept = _globs(watch)
    norm = os.path.normcase
    fold = norm("A") != "A"  # (only Windows folds case: elsewhere the name is matched as it is)
    recursive = watch.recursive
    stack, n, dirs = [root], 0, 0
    try:
        while stack:
            d = stack.pop()
            dirs += 1
            try:
                with os.scandir(d) as it:
                    entries = list(it)
            except OSError as exc:
                log.warning("cannot list %s: %s", d, exc)
                continue
            entries.sort(key=_NAME)
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        if recursive:
                            stack.append(e.path)
                        continue
                    name = norm(e.name) if fold else e.name
                    if accept(name) is None or not e.is_file():
                        continue
                    if allow is not None and e.is_symlink() and not allow(e.path):
                        continue
                except OSError:
                    continue
                yield e.path
                n += 1
                if n >= limit:
                    return
    finally:
        DIRS_SEEN[root] = dirs + len(stack)  # a walk cut short by ``limit`` gives a lower bound


_NAME = operator.attrgetter("name")
DIRS_SEEN: dict[str, int] = {}  # watch root -> directories found by its latest walk


class _Handler(FileSystemEventHandler):
    """``on_path``: a file changed; ``on_tree``: the tree changed in a way only a walk follows (a
    directory came, went or moved); ``on_gone``: a file was deleted: its open descriptor must be
    read out and let go."""

    def __init__(self, on_path: Callable[[str], None], on_tree: Callable[[str], None],
                 on_gone: Callable[[str], None]) -> None:
        self.on_path, self.on_tree, self.on_gone = on_path, on_tree, on_gone

    def on_any_event(self, event: FileSystemEvent) -> None:
        kind = event.event_type
        if event.is_directory:
            if kind in ("created", "moved", "deleted"):
                self.on_tree(os.fsdecode(event.dest_path or event.src_path) if kind == "moved"
                             else os.fsdecode(event.src_path))
        elif kind == "deleted":
            self.on_gone(os.fsdecode(event.src_path))
        elif kind == "moved":   # a rename rotation: the follower sees the new file at the name (and counts it)
            self.on_path(os.fsdecode(event.dest_path))
        else:
            self.on_path(os.fsdecode(event.src_path))


class _OverflowLog(logging.Handler):
    """watchdog reports lost inotify events only as a log line; turn it into a resync."""

    def __init__(self, on_overflow: Callable[[], None]) -> None:
        super().__init__(logging.WARNING)
        self.on_overflow = on_overflow

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self.on_overflow()


class TreeWatcher:
    """One inotify observer for the local watches, one polling observer per poll interval for
    the rest. ``mounts`` and ``watch_limit`` default to the host's (tests pass their own)."""

    def __init__(self, watches: list[Watch], on_path: Callable[[str], None],
                 on_overflow: Callable[[], None], on_error: Callable[[str], None], *,
                 mounts: list[Mount] | None = None, watch_limit: int | None = None) -> None:
        self.watches = watches
        self.on_path, self.on_overflow, self.on_error = on_path, on_overflow, on_error
        self.observer: BaseObserver = Observer()
        self.pollers: dict[float, BaseObserver] = {}
        self.scheduled: set[str] = set()
        self.modes: dict[str, str] = {}  # watch path -> "inotify" | "poll" | "resync"
        self._mounts = mounts
        self.watch_limit = watch_limit if watch_limit is not None else read_watch_limit()
        self._inotify_dirs: dict[str, int] = {}  # inotify watch path -> directories it needs
        self._over_limit_reported = False
        self._started = False
        self._overflow_log = _OverflowLog(on_overflow)
        self._observed: dict[str, ObservedWatch] = {}  # watch path -> the directory given to inotify
        self._ids: dict[str, tuple[int, int] | None] = {}  # watch path -> (device, inode) of that directory
        logging.getLogger("watchdog.observers.inotify_c").addHandler(self._overflow_log)

    def start(self) -> None:
        self.schedule_missing()
        self.observer.start()
        for poller in self.pollers.values():
            poller.start()
        self._started = True

    def schedule_missing(self) -> None:
        """Add observers for watch paths that exist now (a job's log dir may appear later), and
        check that the inotify trees, grown since, still fit under the watch limit."""
        handler = _Handler(self._path_event, lambda _path: self.on_overflow(), self._file_gone)
        alive = self._live_targets()
        for w in self.watches:
            key = str(w.path)
            if key in self.scheduled:
                observed = self._observed.get(key)   # set with mode "inotify"
                if observed is None or (os.fsdecode(observed.path) in alive
                                        and _identity(os.fsdecode(observed.path)) == self._ids.get(key)):
                    continue
                # its inotify watch ended (the watched directory was removed), or the path names
                # another directory now (the old one renamed away: inotify follows its inode):
                # watch it again once it is back; until then the periodic resync's walk finds
                # what it holds
                self._unschedule(key)
            target = key if os.path.isdir(key) else os.path.dirname(key)
            if not os.path.isdir(target):
                continue
            recursive = w.recursive and os.path.isdir(key)
            try:
                if self._polled(w, target):
                    self._poller(w.poll_interval).schedule(handler, target, recursive=recursive,
                                                           event_filter=EVENT_FILTER)
                    self.modes[key] = "poll"
                elif self._fits(key, target, recursive):
                    self._ids[key] = _identity(target)
                    self._observed[key] = self.observer.schedule(handler, target, recursive=recursive,
                                                                 event_filter=EVENT_FILTER)
                    self.modes[key] = "inotify"
                else:
                    self.modes[key] = "resync"
                self.scheduled.add(key)
            except OSError as exc:  # inotify limits, permissions
                self.on_error(f"cannot watch {key}: {exc}; relying on periodic resync")
        self._check_growth()

    def _unschedule(self, key: str) -> None:
        self.scheduled.discard(key)
        self.modes.pop(key, None)
        self._inotify_dirs.pop(key, None)
        self._ids.pop(key, None)
        observed = self._observed.pop(key, None)
        if observed is not None:
            try:
                self.observer.unschedule(observed)
            except (KeyError, OSError):
                pass

    def _live_targets(self) -> set[str]:
        """The directories whose inotify watch is still running."""
        return {os.fsdecode(e.watch.path) for e in list(self.observer.emitters) if e.is_alive()}

    def _file_gone(self, path: str) -> None:
        """A followed file was deleted: its open descriptor must be read out and let go, which a
        walk does; other files' deletes (checkpoints, temp files) ask nothing."""
        if watch_for(self.watches, path) is not None:
            self.on_overflow()   # a resync at once: its walk reads the file out and lets it go

    def _polled(self, w: Watch, target: str) -> bool:
        if w.poll is True or w.poll is False:
            why = "poll: true" if w.poll else ""
        else:
            if self._mounts is None:
                self._mounts = read_mounts()
            m = mount_of(target, self._mounts)
            why = f"{m.fstype} file system at {m.mount_point}" if m and is_network_fs(m.fstype) else ""
        if why:
            log.info("polling %s every %gs (%s): inotify does not see other clients' writes there",
                     w.path, w.poll_interval, why)
        return bool(why)

    def _poller(self, interval: float) -> BaseObserver:
        poller = self.pollers.get(interval)
        if poller is None:
            poller = self.pollers[interval] = PollingObserver(timeout=interval)
            if self._started:
                poller.start()
        return poller

    def _fits(self, key: str, target: str, recursive: bool) -> bool:
        """Whether a new inotify watch stays within max_user_watches; if not, say how to raise it."""
        if self.watch_limit is None:
            return True
        used = sum(self._inotify_dirs.values())
        need = count_dirs(target, self.watch_limit - used) if recursive else 1
        if used + need > self.watch_limit:
            # (counting stopped at the first directory past the limit)
            self.on_error(f"not watching {key} with inotify: its more than {self.watch_limit - used} "
                          f"directories would pass fs.inotify.max_user_watches="
                          f"{self.watch_limit} ({used} in use by this agent); relying on the periodic resync "
                          f"for it. Raise the limit with: sysctl -w fs.inotify.max_user_watches="
                          f"{_suggest(used + need)} (persist in /etc/sysctl.d/), or set 'poll: true' on the watch")
            return False
        self._inotify_dirs[key] = need
        return True

    def _check_growth(self) -> None:
        """Directories created after scheduling get watches too; past the limit the kernel refuses
        them and watchdog drops the failure, so compare with the latest resync's count."""
        if self.watch_limit is None:
            return
        for key in self._inotify_dirs:
            if key in DIRS_SEEN:
                self._inotify_dirs[key] = max(self._inotify_dirs[key], DIRS_SEEN[key])
        total = sum(self._inotify_dirs.values())
        if total > self.watch_limit and not self._over_limit_reported:
            self._over_limit_reported = True
            self.on_error(f"the watched trees grew to {total} directories, past fs.inotify.max_user_watches="
                          f"{self.watch_limit}: new directories are found only by the periodic resync. "
                          f"Raise the limit with: sysctl -w fs.inotify.max_user_watches={_suggest(total)}")

    def _path_event(self, path: str) -> None:
        if watch_for(self.watches, path) is not None:
            self.on_path(path)

    def stop(self) -> None:
        logging.getLogger("watchdog.observers.inotify_c").removeHandler(self._overflow_log)
        for obs in (self.observer, *self.pollers.values()):
            try:
                obs.stop()
                obs.join(timeout=5)
            except RuntimeError:
                pass


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _suggest(needed: int) -> int:
    """A limit with room to grow: twice what is needed, rounded up to a multiple of 65536."""
    return -(-2 * needed // 65536) * 65536
