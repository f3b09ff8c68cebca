"""``nonfinite``: NaN or Inf in a parsed metric, or a trainer saying so in words."""

from __future__ import annotations

import math

from pydantic import field_validator

from ..model import EVAL_LOSS, GRAD_NORM, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, Sample, TRAINING_METRICS
from ..series import SeriesState
from .base import Detector, Hit, Params


class NonfiniteParams(Params):
    metrics: list[str] = [LOSS, GRAD_NORM, EVAL_LOSS, LOSS_SCALE, NONFINITE_MESSAGE]

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

    def wanted_metrics(self) -> frozenset[str]:
        return frozenset(self.params.metrics)

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        if sample.metric == NONFINITE_MESSAGE:
            what = sample.attr("what", "message")
            return Hit(sample.labels + (("metric", what),), f"trainer reported non-finite values ({what})", sample.value,
                       sample.step if sample.step is not None else series.last_step, sample.source,
                       {"metric": what, "value": sample.value})
        if math.isfinite(sample.value):
            return None
        return Hit(sample.labels + (("metric", sample.metric),), f"{sample.metric} is {sample.value}", sample.value,
                   sample.step if sample.step is not None else series.last_step, sample.source,
                   {"metric": sample.metric, "value": repr(sample.value)})
