"""``divergence``: the training loss trends up instead of down.

Two checks, either one is enough:

* **rise**: the last ``rises`` reports each rose above the one before (``rises + 1`` values,
  strictly increasing), by ``min_rise`` (relative to the first of them) and ``min_delta``
  (absolute, in the metric's units) in total. Megatron's 6.37 -> 6.60 -> 7.31 -> 9.12 -> 10.24
  is one.
* **trend**: over the last ``window`` values, the median of the last third exceeds the median of
  the first third by ``min_rise`` (relative) and ``min_delta`` (absolute). Medians ignore single
  spikes, so this fires on a level that moved up and stayed, not on one bad batch.
  ``window: 0`` turns this check off.

The steep fall at the start of training and a noisy plateau never pass either check: the
first needs several consecutive rises adding up to a large absolute rise, the second a
sustained higher level. Non-finite values are ignored (``nonfinite`` reports them).

An event kind: an episode (consecutive values where a check holds) hits at its onset and again
whenever the loss reaches a new high.
"""

from __future__ import annotations

import math
import statistics
from itertools import islice
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from ..model import EVAL_LOSS, LOSS, Labels, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params
from .base import PerSeries, step_of
from .batch import RunView, window


class DivergenceParams(Params):
    metric: Literal["loss", "eval_loss"] = LOSS
    rises: int = Field(4, ge=1)
    window: int = Field(30, ge=0)
    min_rise: float = Field(0.2, ge=0)
    min_delta: float = Field(1.0, ge=0)

    @field_validator("window")
    @classmethod
    def _window(cls, v: int) -> int:
        if 0 < v < 6:
            raise ValueError("window must be 0 (trend check off) or at least 6 values")
        return v


@dataclass(slots=True)  # no __dict__: one per followed series
class _Track:
    values: list = field(default_factory=list)  # a list: an idle series' window costs its values only
    peak: float | None = None


class DivergenceDetector(Detector[DivergenceParams]):
    kind = "divergence"
    params_model = DivergenceParams
    metrics = frozenset({LOSS, EVAL_LOSS})
    stateful = False
    default_resolve_after = 1800.0

    def __init__(self, params: DivergenceParams) -> None:
        super().__init__(params)
        self._tracks: PerSeries[_Track] = PerSeries(_Track)

    def wanted_metrics(self) -> frozenset[str]:
        return frozenset({self.params.metric})

    def _enough(self, start: float, end: float) -> bool:
        p = self.params
        return end - start > 0 and end - start >= max(p.min_delta, p.min_rise * abs(start))

    def plan(self, labels: Labels, run: RunView, metrics: frozenset[str]) -> int:
        # quiet: a value that ends no run of ``rises`` rises large enough, and whose window's last
        # third does not reach min_delta above its first third (a superset of either check)
        p, m = self.params, self.params.metric
        t = self._tracks.value(labels)
        at, w = window(run, m, metrics, t.values if t is not None else (), max(p.rises + 1, p.window))
        if w is None:
            return at
        a = w.values
        n, r = len(a), p.rises
        act = np.zeros(n, dtype=bool)
        with np.errstate(over="ignore", invalid="ignore"):  # +-inf past the float range, as Python's floats
            self._rises_and_thirds(a, act, n, r)
        return w.first(run, m, act, at)

    def _rises_and_thirds(self, a: np.ndarray, act: np.ndarray, n: int, r: int) -> None:
        p = self.params
        if n > r:
            rising = np.concatenate([[0], np.cumsum(a[1:] > a[:-1])])
            j = np.arange(r, n)
            start = a[j - r]
            d = a[j] - start
            act[j] = ((rising[j] - rising[j - r]) == r) & (d > 0) & (d >= np.maximum(p.min_delta, p.min_rise * np.abs(start)))
        if p.window and n >= p.window:
            third = p.window // 3
            win = np.lib.stride_tricks.sliding_window_view(a, third)
            j = np.arange(p.window - 1, n)
            act[j] |= win.max(axis=1)[j - third + 1] - win.min(axis=1)[j - p.window + 1] >= p.min_delta

    def absorb(self, labels: Labels, run: RunView, metrics: frozenset[str], upto: int) -> None:
        p, m = self.params, self.params.metric
        vals, count = run.finite_tail(m, upto, max(p.rises + 1, p.window))
        if not count:
            return
        t = self._tracks.get(labels)
        t.values.extend(vals)
        keep = max(p.rises + 1, p.window)
        if len(t.values) > keep:
            del t.values[:len(t.values) - keep]
        t.peak = None

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        p = self.params
        v = sample.value
        if not math.isfinite(v):
            return None
        t = self._tracks.get(sample.labels)
        values = t.values
        values.append(v)
        n = len(values)
        rises, window = p.rises, p.window
        if n > rises + 1 and n > window:
            del values[:n - max(rises + 1, window)]
            n = max(rises + 1, window)
        evidence: dict | None = None
        # the rise check needs the last value above the one before it (most reports: not)
        if n >= rises + 1 and v > values[-2]:
            run = list(values)[-(rises + 1):]
            if all(b > a for a, b in zip(run, run[1:])) and self._enough(run[0], run[-1]):
                evidence = {"check": "rise", "from": run[0], "to": run[-1], "reports": rises}
        if evidence is None and window and n >= window:
            third = window // 3
            # the values' list holds max(rises + 1, window) values: the window is its last ``window``
            head = list(islice(values, n - window, n - window + third))
            tail = list(islice(values, n - third, n))
            # the medians lie within [min(head), max(tail)]: no rise there, no rise of the medians
            if max(tail) - min(head) >= p.min_delta:
                first, last = statistics.median(head), statistics.median(tail)
                if self._enough(first, last):
                    evidence = {"check": "trend", "from": first, "to": last, "reports": window}
        if evidence is None:
            t.peak = None
            return None
        if t.peak is not None and v <= t.peak:
            return None
        onset = t.peak is None
        t.peak = v if t.peak is None else max(t.peak, v)
        start = evidence["from"]
        rel = (evidence["to"] - start) / abs(start) if start else None
        evidence.update({"metric": p.metric, "value": v, "rise": evidence["to"] - start,
                         "relative_rise": round(rel, 4) if rel is not None else None, "onset": onset})
        how = (f"rose over {p.rises} consecutive reports" if evidence["check"] == "rise"
               else f"trended up over the last {p.window} reports (median of the first/last third)")
        return Hit(sample.labels, f"{p.metric} {how}: {start:.6g} -> {evidence['to']:.6g}"
                   + (f" (+{rel:.0%})" if rel is not None else ""),
                   v, step_of(sample, series), sample.source, evidence)
