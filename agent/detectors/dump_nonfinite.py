"""``dump_nonfinite``: a scanned tensor dump in which an op produced NaN/Inf from finite inputs.

The dump scanner (agent/dumps/scan.py) names the first such op per dump directory; the daemon
turns that into a sample, and this kind turns the sample into an alert labelled with the op.
"""

from __future__ import annotations

from ..model import DUMP_NONFINITE, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params


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
        return Hit(sample.labels + (("op", op),), f"first non-finite output: {op} {tensor}", sample.value,
                   sample.step, sample.source, evidence)
