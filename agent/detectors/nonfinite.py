"""``nonfinite``: NaN or Inf in a parsed metric, or a trainer saying so in words.

A non-finite loss (or a trainer's message) hits at once. A non-finite gradient norm beside a
finite loss is what a loss scaler's skipped step looks like (fp16 with GradScaler, apex,
DeepSpeed): in a run that scales its loss, or may (``SeriesState.loss_scaling`` not "no"), the
series counts it as an overflow event (it feeds the overflow rules) and it hits only once
``grad_norm_persist`` gradient-norm reports in a row were non-finite. In a run without loss
scaling (bf16/fp32, or a scale that is no dynamic one) it hits at once, and so it does where the
producer prints the grad norm of applied steps only (Megatron leaves the field out when every
step of the interval was skipped: a printed NaN went into the weights).
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator

from ..model import EVAL_LOSS, GRAD_NORM, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, Sample, TRAINING_METRICS
from ..series import APPLIED_GRAD_NORM_PRODUCERS, SeriesState
from .base import Detector, Hit, Params, PerSeries


class NonfiniteParams(Params):
    metrics: list[str] = [LOSS, GRAD_NORM, EVAL_LOSS, LOSS_SCALE, NONFINITE_MESSAGE]
    # non-finite grad-norm reports in a row that hit in a run that (may) scale its loss; 1: at once
    grad_norm_persist: int = Field(3, ge=1)

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
        if sample.metric == NONFINITE_MESSAGE:
            what = sample.attr("what", "message")
            return Hit(sample.labels + (("metric", what),), f"trainer reported non-finite values ({what})", sample.value,
                       sample.step if sample.step is not None else series.last_step, sample.source,
                       {"metric": what, "value": sample.value})
        if sample.metric == GRAD_NORM:
            if math.isfinite(sample.value):
                t = self._streaks.peek(sample.labels)
                if t is not None and t.n:
                    t.n = 0
                return None
            t = self._streaks.get(sample.labels)
            t.n += 1
            scaling = series.loss_scaling
            if (scaling != "no" and sample.producer not in APPLIED_GRAD_NORM_PRODUCERS
                    and t.n < self.params.grad_norm_persist):
                return None  # a skipped step of the scaler: an overflow event (agent/series.py)
            return Hit(sample.labels + (("metric", GRAD_NORM),), f"grad_norm is {sample.value}", sample.value,
                       sample.step if sample.step is not None else series.last_step, sample.source,
                       {"metric": GRAD_NORM, "value": repr(sample.value), "reports_in_a_row": t.n,
                        "loss_scaling": scaling})
        if math.isfinite(sample.value):
            return None
        return Hit(sample.labels + (("metric", sample.metric),), f"{sample.metric} is {sample.value}", sample.value,
                   sample.step if sample.step is not None else series.last_step, sample.source,
                   {"metric": sample.metric, "value": repr(sample.value)})


class _Streak:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0  # non-finite grad-norm reports in a row
