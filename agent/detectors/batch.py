"""A run of one series' samples, as a rule sees it when the pipeline judges it in bulk.

Catching up on a backlog, the pipeline (agent/engine/catchup.py) hands each rule a run of
samples of one series at once: the rule's ``Detector.plan`` says from which sample on it may
answer something or change its memory otherwise than ``Detector.absorb`` reproduces (a NaN, a
value above the recent maximum, a scale that moved), looking at the values with numpy; the
samples before that are absorbed in one call, the rest observed one at a time as usual. A rule
without a plan observes every sample. The answers are the same either way
(tests/engine/test_pipeline_batches.py): this only skips calls that cannot change one.

The view computes what rules ask of the run once (the values and positions of a metric, its
producers, which samples carry attributes) and keeps it for the next rule.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

import numpy as np

from ..model import Sample


class RunView:
    """The samples of one run (one series, in order), by metric."""

    __slots__ = ("samples", "n", "_names", "_index", "_values", "_merged", "_producer", "_attrs")

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.n = len(samples)
        self._names: np.ndarray | None = None  # the samples' metrics
        self._index: dict[str, list[int]] | None = None
        self._values: dict[str, np.ndarray] = {}
        self._merged: dict[frozenset[str], list[int]] = {}
        self._producer: Any = False  # not computed yet
        self._attrs: dict[str, int] = {}

    def index(self, metric: str) -> list[int]:
        """Positions (in the run) of the samples of ``metric``, in order."""
        idx = self._index
        if idx is None:
            names = [s.metric for s in self.samples]
            arr = self._names = np.array(names)
            idx = self._index = {m: np.flatnonzero(arr == m).tolist() for m in set(names)}
        return idx.get(metric, [])

    def metrics(self) -> set[str]:
        self.index("")
        assert self._index is not None
        return set(self._index)

    def values(self, metric: str) -> np.ndarray:
        """The values of ``metric`` (float64), in order."""
        v = self._values.get(metric)
        if v is None:
            samples = self.samples
            v = self._values[metric] = np.array([samples[i].value for i in self.index(metric)], dtype=np.float64)
        return v

    def finite_tail(self, metric: str, upto: int, keep: int) -> tuple[list[float], int]:
        """The last ``keep`` finite values of ``metric`` before position ``upto`` (the samples'
        own value objects, in order), and how many finite values lie before ``upto``."""
        idx = self.index(metric)
        k = self.count_before(metric, upto)
        fin = np.flatnonzero(np.isfinite(self.values(metric)[:k]))
        samples = self.samples
        return [samples[idx[j]].value for j in fin[max(0, len(fin) - keep):].tolist()] if keep else [], len(fin)

    def of(self, metrics: frozenset[str]) -> list[int]:
        """Positions of the samples of any of ``metrics``, in order."""
        out = self._merged.get(metrics)
        if out is None:
            self.index("")
            out = self._merged[metrics] = np.flatnonzero(np.isin(self._names, list(metrics))).tolist()
        return out

    def at(self, metric: str, k: int) -> int:
        """Position of the ``k``-th sample of ``metric`` (the run's length past the last)."""
        idx = self.index(metric)
        return idx[k] if k < len(idx) else self.n

    def count_before(self, metric: str, upto: int) -> int:
        """How many samples of ``metric`` lie before position ``upto``."""
        return bisect_left(self.index(metric), upto)

    @staticmethod
    def count_before_in(index: list[int], upto: int) -> int:
        """How many positions of ``index`` (from ``of``) lie before ``upto``."""
        return bisect_left(index, upto)

    def first(self, metrics: frozenset[str] | set[str]) -> int:
        """Position of the first sample of any of ``metrics`` (the run's length if none)."""
        return min((self.at(m, 0) for m in metrics), default=self.n)

    def with_attrs(self, metric: str) -> int:
        """Position of the first sample of ``metric`` that carries attributes (or the length)."""
        at = self._attrs.get(metric)
        if at is None:
            samples = self.samples
            at = self._attrs[metric] = next((i for i in self.index(metric) if samples[i].attrs), self.n)
        return at

    def producer(self) -> str | None:
        """The one producer of every sample of the run; None where they differ."""
        if self._producer is False:
            producers = {s.producer for s in self.samples}
            self._producer = producers.pop() if len(producers) == 1 else None
        return self._producer


class Window:
    """A rule's window over the finite values of one metric, continued by a run: ``values`` are
    the ``held`` values of its memory, then the run's finite values (``finite``: where those lie
    in the metric's order)."""

    __slots__ = ("values", "finite", "held")

    def __init__(self, run: RunView, metric: str, held: Any) -> None:
        v = run.values(metric)
        self.finite = np.flatnonzero(np.isfinite(v))
        self.held = len(held)
        self.values = np.concatenate([np.array(held, dtype=np.float64), v[self.finite]])

    def first(self, run: RunView, metric: str, act: np.ndarray, at: int) -> int:
        """The plan: ``at``, or the position of the first run value ``act`` marks if earlier."""
        k = first_true(act, self.held)
        return at if k is None else min(at, run.at(metric, int(self.finite[k - self.held])))


def window(run: RunView, metric: str, metrics: frozenset[str], held: Any, keep: int) -> tuple[int, Window | None]:
    """The first position of another metric the rule judges, and the rule's ``Window`` (None
    where the run has no value of ``metric``, or the memory holds more than ``keep`` values:
    restored from a longer window, so observed)."""
    at = run.first(metrics - {metric})
    if metric not in metrics:
        return at, None
    if len(held) > keep:
        return 0, None
    return at, Window(run, metric, held)


def sliding(a: np.ndarray, width: int, fn: Any, fill: float) -> np.ndarray:
    """``fn`` (np.max, np.min) of ``a[j - width:j]`` for every j in 0..len(a) (``fill`` where
    the window reaches before the start)."""
    pad = np.concatenate([np.full(width, fill), a])
    return fn(np.lib.stride_tricks.sliding_window_view(pad, width), axis=1)


def first_true(mask: np.ndarray, start: int = 0) -> int | None:
    """Index of the first True of ``mask`` at or after ``start``; None if none."""
    hits = np.flatnonzero(mask[start:])
    return int(hits[0]) + start if hits.size else None
