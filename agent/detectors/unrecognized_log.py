"""``unrecognized_log``: a followed file grows but yields no record (the agent would be blind).

The follower judges each file (agent/readers/yields.py: units read against records yielded, with
the thresholds of ``limits.unrecognized_*``) and sends a ``log_unrecognized`` sample: 1 with the
reason (``unrecognized``: no record ever; ``stopped``: records stopped while the file still
grows), the count of units read since the last record and a few sample lines; 0 when records come
again. ``reason`` picks which verdicts a rule takes. The alert carries the file's run labels and
``file``; it clears when records come and resolves after ``resolve_after`` once the file stops
growing, is excluded or is removed (the follower resends the verdict while the file grows).
"""

from __future__ import annotations

from typing import Literal

from ..model import LOG_UNRECOGNIZED, Sample
from ..series.state import SeriesState
from .base import Clear, Detector, Hit, Params


class UnrecognizedLogParams(Params):
    reason: Literal["unrecognized", "stopped", "any"] = "any"


class UnrecognizedLogDetector(Detector[UnrecognizedLogParams]):
    kind = "unrecognized_log"
    params_model = UnrecognizedLogParams
    metrics = frozenset({LOG_UNRECOGNIZED})

    def observe(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        if not sample.value:
            return Clear(sample.labels)
        reason = sample.attr("reason")
        if self.params.reason not in ("any", reason):
            return None
        units = sample.attr("units", 0)
        what = "yields no record" if reason == "unrecognized" else "stopped yielding records"
        file = dict(sample.labels).get("file", sample.source.path)
        return Hit(sample.labels, f"{file} {what} ({units} lines read)", float(units), None,
                   sample.source, {k: v for k, v in sample.attrs})
