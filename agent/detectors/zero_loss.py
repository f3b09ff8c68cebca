"""``zero_loss``: the loss is exactly 0 (or within ``tolerance`` of it).

A real training loss is practically never exactly 0; a printed ``0.0`` means the loss was
masked out, every label was ignored, or the value was replaced after a non-finite step (HF
Trainer logs ``'loss': 0.0`` next to ``'grad_norm': nan`` when every step in the logging window
was non-finite, as in hf_trainer_1). ``consecutive`` zero values in a row are needed before it
hits, so a fine-tune whose rounded loss prints as 0.0 once can be tolerated.

A state kind: hits when the condition starts, clears at the next non-zero value. Alert label
``metric``.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field

from ..model import EVAL_LOSS, LOSS, Labels, Sample
from ..series.state import SeriesState
from .base import Clear, Detector, Hit, Params
from .base import PerSeries, step_of
from .batch import RunView, first_true

_VALUES = frozenset({LOSS, EVAL_LOSS})


class ZeroLossParams(Params):
    metrics: list[Literal["loss", "eval_loss"]] = Field(default_factory=lambda: [LOSS], min_length=1)
    consecutive: int = Field(1, ge=1)
    tolerance: float = Field(0.0, ge=0)


class _Track:
    __slots__ = ("run", "active", "first_step", "first_source")

    def __init__(self) -> None:
        self.run = 0
        self.active = False
        self.first_step: int | None = None
        self.first_source = None


class ZeroLossDetector(Detector[ZeroLossParams]):
    kind = "zero_loss"
    params_model = ZeroLossParams
    metrics = frozenset({LOSS, EVAL_LOSS})
    stateful = True

    def __init__(self, params: ZeroLossParams) -> None:
        super().__init__(params)
        self._tracks: PerSeries[_Track] = PerSeries(_Track)
        # the alert labels of the last (series labels, metric) seen, reused while they repeat
        self._key: tuple[Labels | None, str] = (None, "")
        self._keyed: Labels = ()

    def wanted_metrics(self) -> frozenset[str]:
        return frozenset(self.params.metrics)

    def plan(self, labels: Labels, run: RunView, metrics: frozenset[str]) -> int:
        # quiet: a non-finite value, and a non-zero one while the condition does not hold
        at = run.first(metrics - _VALUES)
        for m in metrics & _VALUES:
            t = self._tracks.value(labels + (("metric", m),))
            v = run.values(m)
            act = np.isfinite(v)
            if t is None or not t.active:
                act &= ~(np.abs(v) > self.params.tolerance)
            k = first_true(act)
            if k is not None:
                at = min(at, run.at(m, k))
        return at

    def absorb(self, labels: Labels, run: RunView, metrics: frozenset[str], upto: int) -> None:
        samples, last = run.samples, {}
        for m in metrics & _VALUES:  # the last finite value of each metric, in the order they came
            for i in reversed(run.index(m)[:run.count_before(m, upto)]):
                if math.isfinite(samples[i].value):
                    last[m] = i
                    break
        for m in sorted(last, key=last.__getitem__):
            if self._key[0] is labels and self._key[1] == m:
                keyed = self._keyed
            else:
                keyed = self._keyed = labels + (("metric", m),)
                self._key = (labels, m)
            self._tracks.get(keyed).run = 0

    def observe(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        if not math.isfinite(sample.value):
            return None  # NaN/Inf belongs to nonfinite and neither starts nor ends a zero run
        key = (sample.labels, sample.metric)
        if key[0] is self._key[0] and key[1] == self._key[1]:
            labels = self._keyed  # the same tuple as last time: PerSeries finds it at once
        else:
            labels = self._keyed = sample.labels + (("metric", sample.metric),)
            self._key = key
        t = self._tracks.get(labels)
        step = step_of(sample, series)
        if abs(sample.value) > self.params.tolerance:
            t.run = 0
            if t.active:
                t.active = False
                return Clear(labels)
            return None
        if t.run == 0:
            t.first_step, t.first_source = step, sample.source
        t.run += 1
        if t.active or t.run < self.params.consecutive:
            return None
        t.active = True
        return Hit(labels, f"{sample.metric} is {sample.value:g} (exactly zero)" + (f" at step {step}" if step is not None else ""),
                   sample.value, step, sample.source,
                   {"metric": sample.metric, "value": sample.value, "consecutive": t.run,
                    "first_step": t.first_step,
                    "first_line": t.first_source.line if t.first_source is not None else None})
