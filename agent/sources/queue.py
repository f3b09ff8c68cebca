"""A bounded, de-duplicating queue of changed paths between the sources and the worker.

Bursts of events for one file collapse into one entry. When the queue is full the source
does not block (watchdog's thread must keep draining inotify) and does not drop silently:
it asks for a resync, which re-derives the changes from the file system itself.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class Batch:
    paths: list[str] = field(default_factory=list)
    resync: bool = False
    reload_rules: bool = False


class ChangeQueue:
    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._paths: dict[str, None] = {}
        self._resync = False
        self._reload = False
        self._cv = threading.Condition()
        self.overflows = 0

    def put(self, path: str) -> bool:
        with self._cv:
            if path not in self._paths:
                if len(self._paths) >= self.maxsize:
                    self.overflows += 1
                    self._resync = True
                    self._cv.notify()
                    return False
                self._paths[path] = None
            self._cv.notify()
            return True

    def request_resync(self) -> None:
        with self._cv:
            self._resync = True
            self._cv.notify()

    def request_reload(self) -> None:
        with self._cv:
            self._reload = True
            self._cv.notify()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def get(self, timeout: float, debounce: float = 0.0) -> Batch:
        """Wait up to ``timeout`` for work; after the first event wait ``debounce`` more so that
        a burst of appends is read in one go."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not (self._paths or self._resync or self._reload):
                left = deadline - time.monotonic()
                if left <= 0:
                    return Batch()
                self._cv.wait(left)
        if debounce > 0 and self._paths:
            time.sleep(debounce)
        with self._cv:
            batch = Batch(list(self._paths), self._resync, self._reload)
            self._paths.clear()
            self._resync = self._reload = False
            return batch
