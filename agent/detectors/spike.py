"""``spike``: a sudden jump UP of the training loss (or another metric) against its recent past.

A value ``v`` is a spike when, over the last ``window`` earlier finite values of the series
(at least ``min_history`` of them), with ``m`` their median and ``MAD`` their median absolute
deviation, the rise ``v - m`` is at least each of

* ``(ratio - 1) * |m|``   - a relative jump (``ratio`` 1.3: 30 % above the recent median),
* ``min_delta``           - an absolute jump in the metric's units (nats for a cross-entropy
  loss), so batch noise on a loss near 0 is never a spike,
* ``k * 1.4826 * MAD * c(n)`` - a robust k-sigma band, so a noisy plateau is never a spike;
  ``c(n)`` widens it while only ``n`` < 21 earlier values estimate the spread (Student's t
  99 % quantile for n - 1 degrees of freedom over the normal one: 13.7 for two values, 3.0
  for three, 1.2 for ten),

and ``v`` also exceeds the largest of those values by ``min_delta``: a series that already
swung that high recently is noisy, not spiking. With a single earlier value there is no spread
to measure, so the rise must then be ``single_factor`` times the larger of the first two
thresholds (megatron_4's 6.44 -> 11.42 passes at 2.6 times it).

Only rises count, and they are measured against the *median* of what came before, so the steep
fall at the start of training never is one and its first bump (still below the early median)
neither; no warm-up in values is needed beyond ``min_history``. Non-finite values are left to
``nonfinite`` and kept out of the statistics.

An event kind. One spike episode (consecutive spike values) hits at its onset and again at each
new peak, so a spike and its slow recovery give one or two findings, not one per report.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field

from ..model import EVAL_LOSS, GRAD_NORM, LOSS, Labels, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params
from .base import PerSeries, step_of
from .batch import RunView, sliding, window

Metric = Literal["loss", "eval_loss", "grad_norm"]


class SpikeParams(Params):
    metric: Metric = LOSS
    window: int = Field(20, ge=1)
    min_history: int = Field(1, ge=1)
    ratio: float = Field(1.3, gt=1)
    min_delta: float = Field(1.0, ge=0)
    k: float = Field(6.0, ge=0)
    single_factor: float = Field(2.0, ge=1)


@dataclass(slots=True)  # no __dict__: one per followed series
class _Track:
    values: list = field(default_factory=list)  # a list: an idle series' window costs its values only
    peak: float | None = None  # the current episode's peak; None outside an episode


# Student's t 99 % quantiles by degrees of freedom, for the small-sample widening of the k-sigma band
_T99 = (31.821, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764,
        2.718, 2.681, 2.650, 2.624, 2.602, 2.583, 2.567, 2.552, 2.539, 2.528)
_Z99 = 2.326


def small_sample(n: int) -> float:
    """How much wider a k-sigma band must be when ``n`` values estimated the spread."""
    df = n - 1
    if df < 1:
        return _T99[0] / _Z99
    if df <= len(_T99):
        return _T99[df - 1] / _Z99
    return 1.0 + (_T99[-1] / _Z99 - 1.0) * len(_T99) / df


def robust_stats(values: list) -> tuple[float, float]:
    med = statistics.median(values)
    mad = statistics.median(abs(x - med) for x in values)
    return med, mad


class SpikeDetector(Detector[SpikeParams]):
    kind = "spike"
    params_model = SpikeParams
    metrics = frozenset({LOSS, EVAL_LOSS, GRAD_NORM})
    stateful = False
    default_resolve_after = 600.0

    def __init__(self, params: SpikeParams) -> None:
        super().__init__(params)
        self._tracks: PerSeries[_Track] = PerSeries(_Track)

    def wanted_metrics(self) -> frozenset[str]:
        return frozenset({self.params.metric})

    def plan(self, labels: Labels, run: RunView, metrics: frozenset[str]) -> int:
        # quiet: a value that is not above each of the recent ones by min_delta (or comes with
        # too little history), and a non-finite one
        p, m = self.params, self.params.metric
        t = self._tracks.value(labels)
        at, w = window(run, m, metrics, t.values if t is not None else (), p.window)
        if w is None:
            return at
        a = w.values
        recent_max = sliding(a, p.window, np.max, -np.inf)[:len(a)]
        history = np.minimum(np.arange(len(a)), p.window)
        with np.errstate(over="ignore", invalid="ignore"):  # +-inf past the float range, as Python's floats
            quiet = (history < p.min_history) | (a - recent_max < p.min_delta)
        return w.first(run, m, ~quiet, at)

    def absorb(self, labels: Labels, run: RunView, metrics: frozenset[str], upto: int) -> None:
        p, m = self.params, self.params.metric
        vals, count = run.finite_tail(m, upto, p.window)
        if not count:
            return
        t = self._tracks.get(labels)
        if min(len(t.values) + count - 1, p.window) >= p.min_history:
            t.peak = None
        t.values.extend(vals)
        if len(t.values) > p.window:
            del t.values[:len(t.values) - p.window]

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        p = self.params
        v = sample.value
        if not math.isfinite(v):
            return None
        t = self._tracks.get(sample.labels)
        hit: Hit | None = None
        if len(t.values) >= p.min_history and v - max(t.values) < p.min_delta:
            t.peak = None  # not above every recent value by min_delta: no spike, whatever the median
        elif len(t.values) >= p.min_history:
            med, mad = robust_stats(t.values)
            n = len(t.values)
            base = max(p.min_delta, (p.ratio - 1) * abs(med))
            if n == 1:
                need = base * p.single_factor  # one earlier value says nothing about the noise
            else:
                need = max(base, p.k * 1.4826 * mad * small_sample(n))
            delta = v - med
            if delta > 0 and delta >= need and v - max(t.values) >= p.min_delta:
                if t.peak is None or v > t.peak:
                    onset = t.peak is None
                    t.peak = v
                    ratio = v / med if med > 0 else None
                    hit = Hit(sample.labels,
                              f"{p.metric} spiked to {v:.6g} from a recent median of {med:.6g}"
                              + (f" (x{ratio:.2f})" if ratio is not None else "")
                              + ("" if onset else ", a new peak"),
                              v, step_of(sample, series), sample.source,
                              {"metric": p.metric, "value": v, "median": med, "mad": mad,
                               "ratio": round(ratio, 4) if ratio is not None else None,
                               "delta": delta, "threshold": med + need, "history": len(t.values),
                               "onset": onset})
            else:
                t.peak = None
        t.values.append(v)
        if len(t.values) > p.window:
            del t.values[:len(t.values) - p.window]
        return hit
