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
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, Sequence

import numpy as np

from ..model import Sample


class RunView:
    """The samples of one run (one series, in order), by metric."""

    __slots__ = ("samples", "n", "_index", "_values", "_merged", "_producer", "_attrs", "_columns")

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.n = len(samples)
        self._index: dict[str, Sequence[int]] | None = None
        self._values: dict[str, np.ndarray] = {}
        self._merged: dict[frozenset[str], list[int]] = {}
        self._producer: Any = False  # not computed yet
        self._attrs: dict[str, int] = {}
        self._columns: dict[str, list[Any]] = {}

    def column(self, field: str) -> list[Any]:
        """One field of every sample (``"value"``, ``"step"``, ...), in order: read once per run."""
        col = self._columns.get(field)
        if col is None:
            read = _COLUMNS.get(field)
            col = self._columns[field] = read(self.samples) if read else list(map(attrgetter(field), self.samples))
        return col

    def pick(self, field: str, idx: Sequence[int]) -> list[Any] | tuple[Any, ...]:
        """``field`` of the samples at positions ``idx``, in order."""
        col = self.column(field)
        if idx.__class__ is range:
            return col[idx.start:idx.stop:idx.step]
        return itemgetter(*idx)(col) if len(idx) > 1 else [col[i] for i in idx]

    def first_none(self, field: str, metrics: frozenset[str]) -> int:
        """Position of the first sample of any of ``metrics`` whose ``field`` is None (the run's
        length if none)."""
        col = self.column(field)
        if None not in col:
            return self.n
        return next((i for i in self.of(metrics) if col[i] is None), self.n)

    def index(self, metric: str) -> Sequence[int]:
        """Positions (in the run) of the samples of ``metric``, in order."""
        idx = self._index
        if idx is None:
            idx = self._index = positions(self.column("metric"))
        return idx.get(metric, [])

    def metrics(self) -> set[str]:
        self.index("")
        assert self._index is not None
        return set(self._index)

    def values(self, metric: str) -> np.ndarray:
        """The values of ``metric`` (float64), in order."""
        v = self._values.get(metric)
        if v is None:
            v = self._values[metric] = np.array(self.pick("value", self.index(metric)), dtype=np.float64)
        return v

    def finite_tail(self, metric: str, upto: int, keep: int) -> tuple[list[float], int]:
        """The last ``keep`` finite values of ``metric`` before position ``upto`` (the samples'
        own value objects, in order), and how many finite values lie before ``upto``."""
        idx = self.index(metric)
        k = self.count_before(metric, upto)
        fin = np.flatnonzero(np.isfinite(self.values(metric)[:k]))
        samples = self.samples
        return [samples[idx[j]].value for j in fin[max(0, len(fin) - keep):].tolist()] if keep else [], len(fin)

    def of(self, metrics: frozenset[str]) -> Sequence[int]:
        """Positions of the samples of any of ``metrics``, in order."""
        out = self._merged.get(metrics)
        if out is None:
            self.index("")
            assert self._index is not None
            lists = [self._index[m] for m in metrics if m in self._index]
            out = self._merged[metrics] = sorted(chain.from_iterable(lists)) if len(lists) > 1 else \
                list(lists[0]) if lists else []
        return out

    def at(self, metric: str, k: int) -> int:
        """Position of the ``k``-th sample of ``metric`` (the run's length past the last)."""
        idx = self.index(metric)
        return idx[k] if k < len(idx) else self.n

    def count_before(self, metric: str, upto: int) -> int:
        """How many samples of ``metric`` lie before position ``upto``."""
        return bisect_left(self.index(metric), upto)

    def first(self, metrics: frozenset[str] | set[str]) -> int:
        """Position of the first sample of any of ``metrics`` (the run's length if none)."""
        return min((self.at(m, 0) for m in metrics), default=self.n)

    def with_attrs(self, metric: str) -> int:
        """Position of the first sample of ``metric`` that carries attributes (or the length)."""
        at = self._attrs.get(metric)
        if at is None:
            col = self.column("attrs")
            at = self._attrs[metric] = self.n if col.count(()) == self.n else \
                next((i for i in self.index(metric) if col[i]), self.n)
        return at

    def producer(self) -> str | None:
        """The one producer of every sample of the run; None where they differ."""
        if self._producer is False:
            producers = set(self.column("producer"))
            self._producer = producers.pop() if len(producers) == 1 else None
        return self._producer


# the fields rules ask of every sample of a run: a comprehension reads a slotted field faster than attrgetter
_COLUMNS: dict[str, Any] = {
    "metric": lambda samples: [s.metric for s in samples],
    "value": lambda samples: [s.value for s in samples],
    "step": lambda samples: [s.step for s in samples],
    "attrs": lambda samples: [s.attrs for s in samples],
    "producer": lambda samples: [s.producer for s in samples],
}


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


def positions(names: list[str]) -> dict[str, Sequence[int]]:
    """Each name's positions in ``names``, in order (a list, or a ``range``). A backlog's records
    mostly repeat one pattern of metrics (the values of a Megatron line): where ``names`` is a
    pattern of distinct names over and over, a name's positions are a range, found without a
    Python step per name."""
    n = len(names)
    if n:
        try:
            p = names.index(names[0], 1)
        except ValueError:
            p = n
        pattern = names[:p]
        if len(set(pattern)) == p and names == pattern * (n // p) + pattern[:n % p]:
            return {m: range(j, n, p) for j, m in enumerate(pattern)}
    idx: dict[str, Any] = {}  # name -> list of positions
    for i, m in enumerate(names):
        at = idx.get(m)
        if at is None:
            idx[m] = [i]
        else:
            at.append(i)
    return idx


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
