"""``dump_nonfinite``: a scanned tensor dump in which an op produced NaN/Inf from finite inputs.

The dump scanner (agent/dumps/scan.py) names the first such op per dump directory; the daemon
turns that into a sample. This kind keeps one incident per run (agent/detectors/dump_incident.py):
the first bad step is its origin (step, rank, op), later bad steps are counted into it, and the
``dump_step`` markers say which steps were clean (an incident ends after ``clean_steps`` of them)
and when the run started over.
Its evidence ``origin`` says what the op did, and says the origin is uncertain
(``uncertainty`` the why) when a tensor before it could not be read (a truncated file): that one may
be the true first.
"""

from __future__ import annotations

from ..model import DUMP_NONFINITE, DUMP_STEP, Sample
from .base import Clear, Hit
from .dump_incident import IncidentKind, IncidentParams


ORIGIN = "produced NaN/Inf from finite inputs"


class DumpNonfiniteParams(IncidentParams):
    pass


class DumpNonfiniteDetector(IncidentKind[DumpNonfiniteParams]):
    kind = "dump_nonfinite"
    params_model = DumpNonfiniteParams
    metrics = frozenset({DUMP_NONFINITE, DUMP_STEP})
    flag = "nonfinite"

    def bad(self, sample: Sample) -> list[Hit | Clear]:
        message, evidence = "first non-finite output", dict(sample.attrs)
        evidence["origin"], evidence["uncertainty"] = ORIGIN, ""
        if evidence.get("uncertain"):   # an earlier tensor was unreadable (agent/dumps/scan.py first_bad_op)
            earlier = evidence.get("unreadable_before") or ()
            first = earlier[0] if earlier else "?"
            n = evidence.get("unreadable_before_count") or len(earlier)
            evidence["origin"] = f"is the first readable non-finite tensor; origin uncertain ({n} earlier tensor(s) unreadable)"
            evidence["uncertainty"] = (f"Origin uncertain: {n} tensor(s) before it could not be read, the first "
                                       f"{first}; the true first non-finite tensor may be among them.")
            message += f" (origin uncertain: {n} earlier tensor(s) unreadable, first {first})"
        return self.incidents.bad(sample, message, evidence)
