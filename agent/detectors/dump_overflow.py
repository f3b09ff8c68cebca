"""``dump_overflow``: an Ascend overflow debug file (``Opdebug.Node_OpDebug.*``) names an op whose
AI Core / atomic-add unit flagged an overflow.

The scanner decodes each debug file's record (accelerator and status bits), finds the
overflowing op's own dump file by task and stream id, and orders them by the debug files'
timestamps; the daemon turns each overflowing op into a sample (earliest first, a bounded number
per step). This kind alerts on the first ``per_step`` of them in each step, labelled ``op``.
Overflows are routine under dynamic loss scaling, so the shipped rule is a ticket, not a page.
"""

from __future__ import annotations

from pydantic import Field

from ..model import DUMP_OVERFLOW, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params
from .dump_steps import StepQuota


class DumpOverflowParams(Params):
    per_step: int = Field(1, ge=1)   # overflowing ops alerted per step (earliest first)


class DumpOverflowDetector(Detector[DumpOverflowParams]):
    kind = "dump_overflow"
    params_model = DumpOverflowParams
    metrics = frozenset({DUMP_OVERFLOW})

    def __init__(self, params: DumpOverflowParams) -> None:
        super().__init__(params)
        self._quota = StepQuota()

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        if not self._quota.take(sample, self.params.per_step):
            return None
        op = str(sample.attr("op", ""))
        status = sample.attr("status") or f"status {sample.attr('status_code')}"
        return Hit(sample.labels + (("op", op),), f"overflow in {op} ({sample.attr('accelerator')}: {status})",
                   sample.value, sample.step, sample.source, dict(sample.attrs))
