"""Dump-side results kept for the exporters: cross-rank digests and compare outcomes.

Training series live in the pipeline; these come from the dump scan thread, so they are kept in a
small locked book that exporters/dumps.py reads as snapshots. Label sets are the dump watch's
labels plus ``rank`` (digests) or ``mode`` (compares): bounded by the number of watches and ranks
on one host, capped anyway. The last full comparison tables are served as JSON.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ..model import Labels
from .origins import DumpOrigins

MAX_LABEL_SETS = 512
MAX_RESULTS = 16


class DumpBook:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: OrderedDict[Labels, tuple[int, float, int]] = OrderedDict()   # -> step, value, tensors
        self._compares: OrderedDict[Labels, dict[str, float]] = OrderedDict()
        self._results: OrderedDict[str, dict[str, Any]] = OrderedDict()              # unit -> last result
        self.origins = DumpOrigins()   # each rank's first non-finite dump (origins.py)

    @staticmethod
    def _put(d: OrderedDict, key: Any, value: Any, cap: int) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > cap:
            d.popitem(last=False)

    def set_digest(self, labels: Labels, step: int | None, value: int, tensors: int) -> None:
        """The latest step's digest of one rank (an older step never overwrites a newer one)."""
        with self._lock:
            old = self._digests.get(labels)
            if old is not None and step is not None and old[0] > step:
                return
            self._put(self._digests, labels, (step if step is not None else -1, float(value), tensors),
                      MAX_LABEL_SETS)

    def record_compare(self, labels: Labels, unit: str, result: dict[str, Any], diverged: bool,
                       now: float) -> None:
        with self._lock:
            c = self._compares.get(labels) or {"runs": 0, "diverged": 0, "pairs": 0, "unmatched": 0,
                                               "differing": 0, "last": 0.0}
            c["runs"] += 1
            c["diverged"] += int(diverged)
            c["pairs"] = float(result.get("pairs") or 0)
            c["unmatched"] = float(len(result.get("unmatched") or ()))
            c["differing"] = float(result.get("differ_bitwise") or 0)
            c["last"] = now
            self._put(self._compares, labels, c, MAX_LABEL_SETS)
            self._put(self._results, unit, {"unit": unit, "labels": dict(labels), "time": now,
                                            "diverged": diverged, **result}, MAX_RESULTS)

    def results(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(reversed(self._results.values()))

    def snapshot(self) -> tuple[list, list]:
        with self._lock:
            return list(self._digests.items()), [(k, dict(v)) for k, v in self._compares.items()]
