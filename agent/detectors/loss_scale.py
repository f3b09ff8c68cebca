"""``loss_scale``: dynamic loss scaling that has collapsed.

Condition ``floor``: the scale is at or below its floor (1 for TF/NPU and MindSpore, whose
managers clamp there; PyTorch/DeepSpeed have no clamp, so reaching 1 is already abnormal).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..model import LOSS_SCALE, Sample
from ..series import SeriesState
from .base import Clear, Detector, Hit, Params


class LossScaleParams(Params):
    condition: Literal["floor"] = "floor"
    floor: float = Field(1.0, ge=0)


class LossScaleDetector(Detector[LossScaleParams]):
    kind = "loss_scale"
    params_model = LossScaleParams
    metrics = frozenset({LOSS_SCALE})
    stateful = True

    def observe(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        floor = self.params.floor
        if sample.value <= floor:
            return Hit(sample.labels, f"loss scale {sample.value:g} at or below floor {floor:g}",
                       sample.value, sample.step if sample.step is not None else series.last_step,
                       sample.source, {"loss_scale": sample.value, "floor": floor,
                                       "decreases": series.scale_decreases,
                                       "first": series.scale_first, "min": series.scale_min})
        return Clear(sample.labels)
