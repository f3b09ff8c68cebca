"""``dump_overflow``: an Ascend overflow debug file (``Opdebug.Node_OpDebug.*``) names an op whose
AI Core / atomic-add unit flagged an overflow.

The scanner decodes each debug file's record (accelerator and status bits), finds the
overflowing op's own dump file by task and stream id, and orders them by the debug files'
timestamps; the daemon turns each overflowing op into a sample (earliest first, a bounded number
per step). This kind keeps one incident per run (agent/detectors/dump_incident.py): the first
overflowing step's earliest op is its origin, later overflowing steps are counted into it, and
``clean_steps`` steps without an overflow end it. Overflows are routine under dynamic loss
scaling, so the shipped rule is a ticket, not a page.
"""

from __future__ import annotations

from ..model import DUMP_OVERFLOW, DUMP_STEP, Sample
from .base import Clear, Hit
from .dump_incident import IncidentKind, IncidentParams


class DumpOverflowParams(IncidentParams):
    pass


class DumpOverflowDetector(IncidentKind[DumpOverflowParams]):
    kind = "dump_overflow"
    params_model = DumpOverflowParams
    metrics = frozenset({DUMP_OVERFLOW, DUMP_STEP})
    flag = "overflow"

    def bad(self, sample: Sample) -> list[Hit | Clear]:
        status = sample.attr("status") or f"status {sample.attr('status_code')}"
        return self.incidents.bad(sample, f"overflow on {sample.attr('accelerator')} ({status})",
                                  dict(sample.attrs))
