"""File-system sources: one watchdog observer for all watches, plus the tree walk used by
the periodic resync. Sources only say *which* path changed; they never open or parse files.

inotify is treated as a hint (it loses events on queue overflow, and files written right after
``mkdir`` of a new directory are often missed), so the resync walk is the ground truth.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import warnings
from typing import Callable, Iterator

from watchdog.events import (DirCreatedEvent, DirMovedEvent, FileClosedEvent, FileCreatedEvent,
                             FileModifiedEvent, FileMovedEvent, FileSystemEvent, FileSystemEventHandler)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from ..config import Watch

log = logging.getLogger(__name__)
warnings.filterwarnings("ignore", category=RuntimeWarning, module="watchdog")
EVENT_FILTER = [FileCreatedEvent, FileModifiedEvent, FileClosedEvent, FileMovedEvent,
                DirCreatedEvent, DirMovedEvent]


def matches(watch: Watch, path: str) -> bool:
    """Whether a file path belongs to ``watch`` (its include/exclude globs on the file name)."""
    name = os.path.basename(path)
    if any(fnmatch.fnmatch(name, pat) for pat in watch.exclude):
        return False
    return any(fnmatch.fnmatch(name, pat) for pat in watch.patterns)


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


def walk(watch: Watch, limit: int) -> Iterator[str]:
    """Files of a watch, found by listing the tree (at most ``limit``); unreadable dirs skipped."""
    root = str(watch.path)
    if not os.path.exists(root):  # the job may not have created it yet
        return
    if os.path.isfile(root):
        yield root
        return
    stack, n = [root], 0
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            log.warning("cannot list %s: %s", d, exc)
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if watch.recursive:
                        stack.append(e.path)
                elif e.is_file() and matches(watch, e.path):
                    yield e.path
                    n += 1
                    if n >= limit:
                        return
            except OSError:
                continue


class _Handler(FileSystemEventHandler):
    def __init__(self, on_path: Callable[[str], None], on_dir: Callable[[str], None]) -> None:
        self.on_path, self.on_dir = on_path, on_dir

    def on_any_event(self, event: FileSystemEvent) -> None:
        path = os.fsdecode(event.dest_path or event.src_path) if event.event_type == "moved" else os.fsdecode(event.src_path)
        if event.is_directory:
            if event.event_type in ("created", "moved"):
                self.on_dir(path)
        else:
            self.on_path(path)


class _OverflowLog(logging.Handler):
    """watchdog reports lost inotify events only as a log line; turn it into a resync."""

    def __init__(self, on_overflow: Callable[[], None]) -> None:
        super().__init__(logging.WARNING)
        self.on_overflow = on_overflow

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self.on_overflow()


class TreeWatcher:
    def __init__(self, watches: list[Watch], on_path: Callable[[str], None],
                 on_overflow: Callable[[], None], on_error: Callable[[str], None]) -> None:
        self.watches = watches
        self.on_path, self.on_overflow, self.on_error = on_path, on_overflow, on_error
        self.observer: BaseObserver = Observer()
        self.scheduled: set[str] = set()
        self._overflow_log = _OverflowLog(on_overflow)
        logging.getLogger("watchdog.observers.inotify_c").addHandler(self._overflow_log)

    def start(self) -> None:
        self.schedule_missing()
        self.observer.start()

    def schedule_missing(self) -> None:
        """Add observers for watch paths that exist now (a job's log dir may appear later)."""
        handler = _Handler(self._path_event, lambda d: self.on_overflow())
        for w in self.watches:
            key = str(w.path)
            if key in self.scheduled:
                continue
            target = key if os.path.isdir(key) else os.path.dirname(key)
            if not os.path.isdir(target):
                continue
            try:
                self.observer.schedule(handler, target, recursive=w.recursive and os.path.isdir(key),
                                       event_filter=EVENT_FILTER)
                self.scheduled.add(key)
            except OSError as exc:  # inotify limits, permissions
                self.on_error(f"cannot watch {key}: {exc}; relying on periodic resync")

    def _path_event(self, path: str) -> None:
        if watch_for(self.watches, path) is not None:
            self.on_path(path)

    def stop(self) -> None:
        logging.getLogger("watchdog.observers.inotify_c").removeHandler(self._overflow_log)
        try:
            self.observer.stop()
            self.observer.join(timeout=5)
        except RuntimeError:
            pass

