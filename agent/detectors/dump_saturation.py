"""``fp16_saturation``: fp16 values at ±65504 in an op's dumped outputs.

Ascend training chips in saturation mode (Atlas training series / 910) clamp an fp16 overflow
to ±65504 instead of producing Inf, so a NaN/Inf rule never sees it (ascend-formats.md §2.6).
The scanner counts such values per tensor; the daemon gives one sample per op with saturated
outputs, in execution order. This kind alerts on the first op of each step whose count reaches
``min_count``, labelled ``op``.
"""

from __future__ import annotations

from pydantic import Field

from ..model import DUMP_FP16_SATURATED, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params
from .dump_steps import StepQuota


class Fp16SaturationParams(Params):
    min_count: int = Field(1, ge=1)  # saturated values an op's outputs must hold to count


class Fp16SaturationDetector(Detector[Fp16SaturationParams]):
    kind = "fp16_saturation"
    params_model = Fp16SaturationParams
    metrics = frozenset({DUMP_FP16_SATURATED})

    def __init__(self, params: Fp16SaturationParams) -> None:
        super().__init__(params)
        self._quota = StepQuota()

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        if sample.value < self.params.min_count or not self._quota.take(sample, 1):
            return None
        op = str(sample.attr("op", ""))
        return Hit(sample.labels + (("op", op),),
                   f"{int(sample.value)} fp16 value(s) at ±65504 in {op} {sample.attr('tensor', '')}",
                   sample.value, sample.step, sample.source, dict(sample.attrs))
