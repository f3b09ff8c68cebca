"""What the daemon's rescans of a dump directory need not read again: per-file results, kept by
the file's identity.

A dump root that holds its tensors directly (``.npy`` files, msprobe-like files written flat) is
one scan unit that grows at every step; without this, each new file rescanned all the others
(quadratic over a run), and each unreadable file failed (and was reported) again at every rescan.
The scan thread keeps a :class:`ScanCache`: a plain ``.npy``/``.npz`` file's tensors or its error,
and each tensor's statistics or error, under ``(path, device, inode, size, mtime)``. A file whose
identity changed is read again (and its error, if any, is new); an unchanged one is answered from
here. The cache is an LRU bounded by its estimated size (``max_bytes``, 48 MiB: about 80,000
unreadable files, or 15,000 ``.npy`` files): past it the oldest entries are read again when next
needed, memory stays bounded. Only the scan thread uses it (no lock).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from ..model import TensorStats
from .types import DumpTensor

CAUSES = ("io", "truncated", "limit", "invalid")   # why a dump file is unreadable (a metric label)
_CAUSE_WORDS = (
    ("truncated", ("truncated", "too short", "runs past the end", "exceeds the file", "header says",
                   "file has", "is not a multiple")),
    ("limit", ("limit", "larger than", "exceeds", "implausibly", "stopped after", "too deeply", "more than",
               "refused", "compression ratio", "too big")),
    ("io", ("cannot read", "cannot list", "cannot map", "permission", "no such file", "input/output",
            "changed while reading", "not a regular file", "errno")),
)
MAX_BYTES = 48 << 20   # the cache's memory, estimated per entry (below)
_ERROR_COST, _TENSOR_COST, _STATS_COST = 600, 2000, 1300   # bytes, measured (tracemalloc, CPython 3.11)
Identity = tuple[str, int, int, int, int]


def identity(path: str) -> Identity | None:
    """(path, device, inode, size, mtime in ns) of a file; None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ScanCache:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0   # the estimated size of the entries held
        self._entries: OrderedDict[int, tuple[int, Any]] = OrderedDict()   # hash of the key -> (cost, value)
        self._ids: dict[str, Identity | None] = {}
        self.read: set[str] = set()                    # files read (not answered from here) this scan
        self.hits: set[str] = set()                    # files answered from here this scan
        self.replayed: set[tuple[str, str]] = set()    # (path, reason): errors answered from here this scan

    def begin(self) -> None:
        """A new scan: identities are taken afresh, the per-scan tallies start empty."""
        self._ids.clear()
        self.read.clear()
        self.hits.clear()
        self.replayed.clear()

    def files_read(self, files: list) -> int:
        """How many of a scan's ``files`` were read: all but those answered only from here."""
        skipped = self.hits - self.read
        return sum(1 for f in files if str(f) not in skipped)

    def __len__(self) -> int:
        return len(self._entries)

    def identity(self, path: str) -> Identity | None:
        """The identity of ``path`` as this scan saw it (stat'ed once per scan)."""
        if path not in self._ids:
            self._ids[path] = identity(path)
        return self._ids[path]

    def _get(self, key: tuple) -> Any:
        found = self._entries.get(hash(key))   # 64 bits of (path, device, inode, size, mtime, ...)
        if found is None:
            return None
        self._entries.move_to_end(hash(key))
        return found[1]

    def _put(self, key: tuple, value: Any, cost: int) -> None:
        h = hash(key)
        old = self._entries.pop(h, None)
        if old is not None:
            self.bytes -= old[0]
        self._entries[h] = (cost, value)
        self.bytes += cost
        while self.bytes > self.max_bytes and self._entries:
            self.bytes -= self._entries.popitem(last=False)[1][0]

    # -- a plain .npy/.npz file: its tensors, or why it cannot be read ---------------------------
    def file(self, path: str) -> tuple[list[DumpTensor], list[tuple[str, str]]] | None:
        ident = self.identity(path)
        found = self._get(("file", ident)) if ident is not None else None
        if found is None:
            self.read.add(path)
            return None
        tensors, reasons = found
        errors = [(path, r) for r in reasons]
        self.hits.add(path)
        self.replayed.update(errors)
        return list(tensors), errors

    def put_file(self, path: str, tensors: list[DumpTensor], errors: list[tuple[str, str]]) -> None:
        ident = self.identity(path)
        if ident is not None and all(p == path for p, _ in errors):
            self._put(("file", ident), (tuple(tensors), tuple(r for _, r in errors)),
                      _ERROR_COST * len(errors) + _TENSOR_COST * len(tensors))

    # -- one tensor's statistics, or why its data cannot be read ---------------------------------
    def _stats_key(self, t: DumpTensor) -> tuple | None:
        ident = self.identity(t.path) if t.path and t.load is not None else None
        return ("stats", ident, t.name, t.io, t.index, t.dtype, t.shape) if ident is not None else None

    def stats(self, t: DumpTensor) -> TensorStats | str | None:
        """The tensor's statistics, or the reason it could not be read, as last time; None: read it."""
        key = self._stats_key(t)
        found = self._get(key) if key is not None else None
        if found is None:
            self.read.add(t.path)
            return None
        self.hits.add(t.path)
        if isinstance(found, str):
            self.replayed.add((t.path or t.name, found))
        return found

    def put_stats(self, t: DumpTensor, value: TensorStats | str) -> None:
        key = self._stats_key(t)
        if key is not None:
            self._put(key, value, _ERROR_COST if isinstance(value, str) else _STATS_COST)


def cause_of(reason: str) -> str:
    """The kind of a scan error, one of :data:`CAUSES`: ``io`` (the file could not be read: gone,
    denied, an I/O error), ``truncated``, ``limit`` (past a bound of the readers) or ``invalid``
    (not a dump of any known layout, or a corrupt one)."""
    low = reason.lower()
    for cause, words in _CAUSE_WORDS:
        if any(w in low for w in words):
            return cause
    return "invalid"
