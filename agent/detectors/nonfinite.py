"""``nonfinite``: NaN or Inf in a parsed metric, or a trainer saying so in words.

A non-finite loss (or a trainer's message) hits at once. A non-finite gradient norm beside a
finite loss is what a loss scaler's skipped step looks like (fp16 with GradScaler, apex,
DeepSpeed): in a run that scales its loss, or may (``SeriesState.loss_scaling`` not "no"), the
series counts it as an overflow event (it feeds the overflow rules) and it hits only once
``grad_norm_persist`` gradient-norm reports in a row were non-finite, after the first
``grad_norm_warmup`` reports (the scale's fall from its initial value overflows a few steps in a
row) and not counting reports the scaler explained with a back-off of its own. In a run without loss
scaling (bf16/fp32, or a scale that is no dynamic one) it hits at once, and so it does where the
producer prints the grad norm of applied steps only (Megatron leaves the field out when every
step of the interval was skipped: a printed NaN went into the weights).

Megatron's ``number of nan iterations: N`` counts iterations whose loss was NaN/Inf and that it
skipped. It is evidence, not a value of its own: on a report (the same line, or the same step)
that also shows a non-finite loss or grad norm it adds no alert (that report pages, once). Alone,
it is the only sign of the incident (a skipped iteration's loss is not in the printed average),
so it hits, as ``metric="nan_iterations"``: one alert for the incident, however many reports
keep counting, resolving ``resolve_after`` after the last.

A loss of exactly 0 beside a non-finite grad norm of the same report is a hidden NaN loss: HF
Trainer's ``logging_nan_inf_filter`` (on by default) logs a non-finite step's loss as the mean
of the window's finite losses, 0 when none was finite, so after a fault every report reads
``{'loss': '0', 'grad_norm': 'nan'}``. Whichever of the pair comes first (stdout prints the loss
first; an event file may order its tags either way), it hits at once in a run without loss scaling
(``hidden_nan_loss``). Where the run scales its loss, or may, it hits on the second report in a row
that shows the pair: HF 4.x prints ``round(loss, 4)``, so a converged loss below 5e-5 reads ``0.0``
and one routine scaler overflow gives ``{'loss': 0.0, 'grad_norm': inf}`` once; the filter's
stand-in repeats on every report after the fault.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field, field_validator

from ..model import (EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, Labels, Sample,
                     SourcePos, TRAINING_METRICS)
from ..series.state import APPLIED_GRAD_NORM_PRODUCERS, SeriesState
from .base import Detector, Hit, Params, PerSeries
from .batch import RunView, first_true

_VALUES = frozenset({LOSS, GRAD_NORM, EVAL_LOSS, LOSS_SCALE, LEARNING_RATE})  # plain values: quiet while finite

NAN_ITERATIONS = "nan_iterations"  # Megatron's counter (readers/parsers/megatron.py)


class NonfiniteParams(Params):
    metrics: list[str] = [LOSS, GRAD_NORM, EVAL_LOSS, LOSS_SCALE, NONFINITE_MESSAGE]
    # non-finite grad-norm reports in a row that hit in a run that (may) scale its loss; 1: at once
    grad_norm_persist: int = Field(3, ge=1)
    # a loss-scaled run's first reports overflow while the scale falls from its initial value
    # (GradScaler 2^16, DeepSpeed up to 2^32): non-finite grad norms among them are warm-up
    grad_norm_warmup: int = Field(16, ge=0)
    # a loss of exactly 0 beside a non-finite grad norm of the same report hits (HF's
    # logging_nan_inf_filter writes 0 for a NaN loss): at once without loss scaling, else on the
    # second such report in a row
    hidden_nan_loss: bool = True

    @field_validator("metrics")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        known = set(TRAINING_METRICS) | {NONFINITE_MESSAGE}
        bad = [m for m in v if m not in known]
        if bad:
            raise ValueError(f"unknown metric(s) {bad}; known: {sorted(known)}")
        return v


class NonfiniteDetector(Detector[NonfiniteParams]):
    kind = "nonfinite"
    params_model = NonfiniteParams
    metrics = frozenset(TRAINING_METRICS) | {NONFINITE_MESSAGE}

    def __init__(self, params: NonfiniteParams) -> None:
        super().__init__(params)
        self._streaks: PerSeries[_Streak] = PerSeries(_Streak)

    def wanted_metrics(self) -> frozenset[str]:
        return frozenset(self.params.metrics)

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        if self.params.hidden_nan_loss and sample.metric in (LOSS, GRAD_NORM):
            hit = self._hidden_nan_loss(sample, series)
            if hit is not None:
                return hit
        if sample.metric == NONFINITE_MESSAGE:
            what = sample.attr("what", "message")
            if what == NAN_ITERATIONS and self._shown(sample):
                return None  # evidence for the loss/grad-norm incident of the same report, not a second page
            return Hit(sample.labels + (("metric", what),), f"trainer reported non-finite values ({what})", sample.value,
                       sample.step if sample.step is not None else series.last_step, sample.source,
                       {"metric": what, "value": sample.value})
        if sample.metric == GRAD_NORM:
            t = self._streaks.peek(sample.labels) or self._streaks.get(sample.labels)
            if t.reports < self.params.grad_norm_warmup:
                t.reports += 1
            if math.isfinite(sample.value):
                if t.n:
                    t.n = 0
                return None
            self._saw(sample)
            scaling = series.loss_scaling
            scaled = scaling != "no" and sample.producer not in APPLIED_GRAD_NORM_PRODUCERS
            if scaled:
                if t.reports < self.params.grad_norm_warmup:
                    return None  # warm-up: the scale is still coming down from its initial value
                if series.gradnorm_explained and (series.scale_last is None or series.scale_last > 1.0):
                    return None  # the scaler said so and backed off: a skipped step, not a persisting fault
            t.n += 1
            if scaled and t.n < self.params.grad_norm_persist:
                return None  # a skipped step of the scaler: an overflow event (agent/series/state.py)
            return Hit(sample.labels + (("metric", GRAD_NORM),), f"grad_norm is {sample.value}", sample.value,
                       sample.step if sample.step is not None else series.last_step, sample.source,
                       {"metric": GRAD_NORM, "value": repr(sample.value), "reports_in_a_row": t.n,
                        "loss_scaling": scaling})
        if math.isfinite(sample.value):
            return None
        if sample.metric == LOSS:
            self._saw(sample)
        return Hit(sample.labels + (("metric", sample.metric),), f"{sample.metric} is {sample.value}", sample.value,
                   sample.step if sample.step is not None else series.last_step, sample.source,
                   {"metric": sample.metric, "value": repr(sample.value)})

    def plan(self, labels: Labels, run: RunView, metrics: frozenset[str]) -> int:
        # finite values answer None (a loss of exactly 0 may be a hidden NaN: observed); a
        # trainer's message is observed
        at = run.first(metrics - _VALUES)
        for m in metrics & _VALUES:
            v = run.values(m)
            bad = ~np.isfinite(v)
            if m == LOSS and self.params.hidden_nan_loss:
                bad |= v == 0.0
            k = first_true(bad)
            if k is not None:
                at = min(at, run.at(m, k))
        return at

    def absorb(self, labels: Labels, run: RunView, metrics: frozenset[str], upto: int) -> None:
        hidden = self.params.hidden_nan_loss
        if hidden and LOSS in metrics and run.count_before(LOSS, upto):
            t = self._streaks.get(labels)
            t.zero_loss_at = None
            t.pairs = 0
        k = run.count_before(GRAD_NORM, upto) if GRAD_NORM in metrics else 0
        if k:
            # as observe: the hidden-NaN check gets the streak (most recently seen); without it a
            # finite grad norm only peeks (the series keeps its place in the LRU order)
            t = self._streaks.get(labels) if hidden else (self._streaks.peek(labels) or self._streaks.get(labels))
            if hidden:
                t.bad_norm = run.samples[run.index(GRAD_NORM)[k - 1]].value
                t.bad_norm_at = None
                t.pairs = 0
            if t.reports < self.params.grad_norm_warmup:
                t.reports = min(self.params.grad_norm_warmup, t.reports + k)
            if t.n:
                t.n = 0

    def _saw(self, sample: Sample) -> None:
        """Remember the report of a non-finite loss or grad norm (for ``_shown``)."""
        t = self._streaks.get(sample.labels)
        t.bad_step, t.bad_at = sample.step, sample.source

    def _shown(self, sample: Sample) -> bool:
        """Whether the report of a ``number of nan iterations: N`` counter (the same line, or the
        same step) also showed a non-finite loss or grad norm."""
        t = self._streaks.peek(sample.labels)
        if t is None or (t.bad_at is None and t.bad_step is None):
            return False
        same_line = t.bad_at is not None and sample.source is not None and \
            (t.bad_at.path, t.bad_at.line) == (sample.source.path, sample.source.line)
        return same_line or (sample.step is not None and t.bad_step == sample.step)

    def _hidden_nan_loss(self, sample: Sample, series: SeriesState) -> Hit | None:
        """A zero loss and a non-finite grad norm from the same report (same step, or the same
        line where the report has no step), in either order."""
        t = self._streaks.get(sample.labels)
        if sample.metric == LOSS:
            if sample.value != 0.0:
                t.zero_loss_at = None
                t.pairs = 0  # a report with a non-zero loss ends a run of hidden-NaN reports
                return None
            here = t.zero_loss_at = _report(sample)
            if t.bad_norm_at != here:
                return None
            norm, loss_sample = t.bad_norm, sample
        else:
            t.bad_norm = sample.value
            if math.isfinite(sample.value):
                t.bad_norm_at = None
                t.pairs = 0  # a finite grad norm ends it too
                return None
            here = t.bad_norm_at = _report(sample)
            if t.zero_loss_at != here:
                return None
            norm, loss_sample = sample.value, sample
        t.zero_loss_at = t.bad_norm_at = None  # one hit per report
        t.pairs += 1
        if t.pairs == 1:   # the incident's first report: the page names it, even when it waits for a second
            t.first_step = loss_sample.step if loss_sample.step is not None else series.last_step
            t.first_at = loss_sample.source
        scaling = series.loss_scaling
        if scaling != "no" and t.pairs < 2:
            return None  # once: may be a rounded converged loss beside a scaler's skipped step
        return Hit(sample.labels + (("metric", LOSS),), f"loss is hidden NaN/Inf (logged 0 beside grad_norm {norm})",
                   math.nan, t.first_step, t.first_at,
                   {"metric": LOSS, "value": "0 (hidden non-finite)", "grad_norm": repr(norm),
                    "hidden_by": "logging_nan_inf_filter", "reports_in_a_row": t.pairs,
                    "loss_scaling": scaling})


def _report(sample: Sample) -> str:
    """Which report a sample belongs to: its step, or its line where it has no step (a string,
    so the detector memory can store it: agent/store/memory.py keeps scalars only)."""
    src = sample.source
    return f"{sample.step}|{src.path if src else ''}|{src.line if src and sample.step is None else -1}"


class _Streak:
    __slots__ = ("n", "reports", "bad_step", "bad_at", "zero_loss_at", "bad_norm_at", "bad_norm", "pairs",
                 "first_step", "first_at")

    def __init__(self) -> None:
        self.n = 0        # non-finite grad-norm reports in a row (after warm-up)
        self.reports = 0  # grad-norm reports of the series so far, counted up to the warm-up's end
        self.bad_step: int | None = None     # step and line of the last non-finite loss or grad norm
        self.bad_at: SourcePos | None = None
        self.zero_loss_at: str | None = None  # "step|path|line" of the last report whose loss was 0
        self.bad_norm_at: str | None = None   # the same for the last non-finite grad norm
        self.bad_norm = math.nan
        self.pairs = 0  # reports in a row that showed a zero loss beside a non-finite grad norm
        self.first_step: int | None = None     # step and line of the first of them
        self.first_at: SourcePos | None = None
