"""``dump_nonfinite``: a scanned tensor dump in which an op produced NaN/Inf from finite inputs.

The dump scanner (agent/dumps/scan.py) names the first such op per dump directory; the daemon
turns that into a sample, and this kind turns the sample into an alert labelled with the op.
Its evidence ``origin`` says what the op did, and says the origin is uncertain (``uncertainty``
the why) when a tensor before it could not be read (a truncated file): that one may be the true
first.
"""

from __future__ import annotations

from ..model import DUMP_NONFINITE, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params


ORIGIN = "produced NaN/Inf from finite inputs"


class DumpNonfiniteParams(Params):
    pass


class DumpNonfiniteDetector(Detector[DumpNonfiniteParams]):
    kind = "dump_nonfinite"
    params_model = DumpNonfiniteParams
    metrics = frozenset({DUMP_NONFINITE})

    def observe(self, sample: Sample, series: SeriesState) -> Hit:
        op = str(sample.attr("op", ""))
        tensor = str(sample.attr("tensor", ""))
        evidence = {k: v for k, v in sample.attrs}
        message = f"first non-finite output: {op} {tensor}"
        evidence["origin"], evidence["uncertainty"] = ORIGIN, ""
        if evidence.get("uncertain"):   # an earlier tensor was unreadable (agent/dumps/scan.py first_bad_op)
            earlier = evidence.get("unreadable_before") or ()
            first = earlier[0] if earlier else "?"
            n = evidence.get("unreadable_before_count") or len(earlier)
            evidence["origin"] = f"is the first readable non-finite tensor; origin uncertain ({n} earlier tensor(s) unreadable)"
            evidence["uncertainty"] = (f"Origin uncertain: {n} tensor(s) before it could not be read, the first "
                                       f"{first}; the true first non-finite tensor may be among them.")
            message += f" (origin uncertain: {n} earlier tensor(s) unreadable, first {first})"
        return Hit(sample.labels + (("op", op),), message, sample.value, sample.step, sample.source, evidence)
