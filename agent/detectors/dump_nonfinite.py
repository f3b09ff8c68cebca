"""``dump_nonfinite``: a scanned tensor dump in which an op produced NaN/Inf from finite inputs.

The dump scanner (agent/dumps/scan.py) names the first such op per dump directory; the daemon
turns that into a sample. This kind keeps one incident per run (agent/detectors/dump_incident.py):
the first bad step is its origin (step, rank, op), later bad steps are counted into it, and the
``dump_step`` markers say which steps were clean (an incident ends after ``clean_steps`` of them)
and when the run started over.
"""

from __future__ import annotations

from ..model import DUMP_NONFINITE, DUMP_STEP, Sample
from .base import Clear, Hit
from .dump_incident import IncidentKind, IncidentParams


class DumpNonfiniteParams(IncidentParams):
    pass


class DumpNonfiniteDetector(IncidentKind[DumpNonfiniteParams]):
    kind = "dump_nonfinite"
    params_model = DumpNonfiniteParams
    metrics = frozenset({DUMP_NONFINITE, DUMP_STEP})
    flag = "nonfinite"

    def bad(self, sample: Sample) -> list[Hit | Clear]:
        return self.incidents.bad(sample, "first non-finite output", dict(sample.attrs))
