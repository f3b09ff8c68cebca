"""``stuck``: the loss stopped improving.

The typical loss level of the last ``window`` values (their median) is compared with that of up
to ``window`` values before them; the run is stuck when the recent level is not lower by more
than ``min_improvement`` (relative). Judged once ``window + min_before`` values were seen
(defaults 50 + 20: hf_trainer_5's 75 reports are judged from the 70th on, and hf_trainer_3's
63-report fine-tune is too short to be judged).
Medians, not minima: on a noisy curve the best single value keeps creeping down by luck
(hf_trainer_5: the minimum of the last 50 values is 1.3 % below the minimum before although
nothing is learnt; the medians differ by 0.05 %).

Loss alone cannot tell a stuck run from one that has converged: late in a long run the loss also
improves by well under 1 % over a few dozen reports. Size ``window`` (in reports) to your log
interval, or lower ``min_improvement``, for long runs. A level of exactly 0 is left to
``zero_loss``.

A state kind: hits when the run becomes stuck, clears when the level improves again.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field

from ..model import EVAL_LOSS, LOSS, Labels, Sample
from ..series.state import SeriesState
from .base import Clear, Detector, Hit, Params
from .base import PerSeries, step_of
from .batch import RunView, window


class StuckParams(Params):
    metric: Literal["loss", "eval_loss"] = LOSS
    window: int = Field(50, ge=2)
    min_before: int = Field(20, ge=1)
    min_improvement: float = Field(0.01, ge=0, lt=1)


@dataclass
class _Track:
    values: list = field(default_factory=list)  # a list: an idle series' window costs its values only
    active: bool = False

    def sorted_windows(self, window: int) -> tuple[list[float], list[float]]:
        """The values before the last ``window`` and the last ``window``, each sorted (ties in
        the order they came, as ``sorted`` of the window keeps them). Kept up to date by
        ``add`` as the values slide; rebuilt when ``values`` is not the list they were made
        from (a track restored from the state store). Not fields: never persisted."""
        cache = self.__dict__.get("_sorted")
        if cache is None or cache[0] is not self.values or cache[1] != len(self.values):
            vals = list(self.values)
            cache = self._sorted = (self.values, len(vals), sorted(vals[:-window]), sorted(vals[-window:]))
        return cache[2], cache[3]

    def add(self, v: float, window: int) -> tuple[list[float], list[float]]:
        """Append ``v``, keeping at most ``2 * window`` values and the sorted windows in step;
        returns them (``sorted_windows``)."""
        values = self.values
        cache = self.__dict__.get("_sorted")
        if cache is not None and cache[0] is values and cache[1] == len(values):
            before, recent = cache[2], cache[3]
        else:
            before, recent = self.sorted_windows(window)
        values.append(v)
        insort(recent, v)  # after equal values: the newest of them
        if len(values) > window:
            x = values[-window - 1]  # the oldest recent value moves to the values before
            del recent[bisect_left(recent, x)]  # the first of equal values: the oldest
            insort(before, x)
            while len(values) > 2 * window:
                y = values[0]
                del values[0]
                del before[bisect_left(before, y)]
        self._sorted = (values, len(values), before, recent)
        return before, recent


def _median(s: list[float]) -> float:
    """``statistics.median`` of an already sorted, non-empty list (the same arithmetic)."""
    n = len(s)
    if n % 2 == 1:
        return s[n // 2]
    i = n // 2
    return (s[i - 1] + s[i]) / 2


class StuckDetector(Detector[StuckParams]):
    kind = "stuck"
    params_model = StuckParams
    metrics = frozenset({LOSS, EVAL_LOSS})
    stateful = True

    def __init__(self, params: StuckParams) -> None:
        super().__init__(params)
        self._tracks: PerSeries[_Track] = PerSeries(_Track)

    def wanted_metrics(self) -> frozenset[str]:
        return frozenset({self.params.metric})

    def plan(self, labels: Labels, run: RunView, metrics: frozenset[str]) -> int:
        # quiet: too few values yet, or (with full windows) the level judged as the state is:
        # improving while not stuck, not improving while stuck; a young series' windows, and a
        # median improvement within a hair of the threshold, are observed
        p, m = self.params, self.params.metric
        t = self._tracks.value(labels)
        active = t is not None and t.active
        at, win = window(run, m, metrics, t.values if t is not None else (), 2 * p.window)
        if win is None:
            return at
        a, w = win.values, p.window
        n = len(a)
        size = np.minimum(np.arange(1, n + 1), 2 * w)
        act = (size >= w + p.min_before) & (size < 2 * w)
        if n >= 2 * w:
            rows = np.lib.stride_tricks.sliding_window_view(a, 2 * w)  # row i: the values up to i + 2w - 1
            before, recent = rows[:, :w], rows[:, w:]
            low, high = before.min(axis=1), recent.max(axis=1)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # inf and nan, as Python floats
                fast = (low > 0) & (high >= 0) & (1 - high / low > p.min_improvement)
                quiet = ~fast if active else fast.copy()
                slow = np.flatnonzero(~fast)
                ref, now = np.median(before[slow], axis=1), np.median(recent[slow], axis=1)
                imp = (ref - now) / np.abs(ref)
                margin = 1e-9 * max(p.min_improvement, 1e-3)
                ok = imp < p.min_improvement - margin if active else imp > p.min_improvement + margin
                quiet[slow] = (ref == 0) | ok
            act[2 * w - 1:] = ~quiet
        return win.first(run, m, act, at)

    def absorb(self, labels: Labels, run: RunView, metrics: frozenset[str], upto: int) -> None:
        m, w = self.params.metric, self.params.window
        vals, count = run.finite_tail(m, upto, 2 * w)
        if not count:
            return
        t = self._tracks.get(labels)
        t.values.extend(vals)
        if len(t.values) > 2 * w:
            del t.values[:len(t.values) - 2 * w]
        t._sorted = None  # the sorted windows are made again from the values when next asked

    def observe(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        p = self.params
        v = sample.value
        if not math.isfinite(v):
            return None
        t = self._tracks.get(sample.labels)
        before, recent = t.add(v, p.window)
        if len(t.values) < p.window + p.min_before:
            return None
        low_before, high_recent = before[0], recent[-1]
        if low_before > 0 and high_recent >= 0 and 1 - high_recent / low_before > p.min_improvement:
            # every recent value is below every earlier one by more than the threshold: the medians
            # can only say "improving" (the common case of a falling loss)
            improvement = p.min_improvement + 1.0
        else:
            ref, now = _median(before), _median(recent)
            if ref == 0:
                return None
            improvement = (ref - now) / abs(ref)
        if improvement > p.min_improvement:
            if t.active:
                t.active = False
                return Clear(sample.labels)
            return None
        if t.active:
            return None
        t.active = True
        return Hit(sample.labels,
                   f"{p.metric} not improving: median of the last {p.window} values {now:.6g} vs "
                   f"{ref:.6g} before ({improvement:+.2%}, need > {p.min_improvement:.2%})",
                   v, step_of(sample, series), sample.source,
                   {"metric": p.metric, "median_recent": now, "median_before": ref,
                    "improvement": round(improvement, 6), "window": p.window, "before": len(before),
                    "best_recent": min(recent), "best_before": min(before)})
