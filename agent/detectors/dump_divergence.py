"""``dump_divergence``: a step's dump no longer matches the benchmark run's dump of the same step.

The daemon compares a watched dump directory with its configured benchmark (agent/compare) when
both sides of a step are complete; a verdict of "diverged" becomes one sample, and this kind turns
it into an alert labelled with the op that lost precision. The full comparison table stays in the
JSON API and a CSV file: op names are unbounded, so only the first diverging op becomes a label.
"""

from __future__ import annotations

from ..model import DUMP_DIVERGENCE, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params



class DumpDivergenceParams(Params):
    pass


class DumpDivergenceDetector(Detector[DumpDivergenceParams]):
    kind = "dump_divergence"
    params_model = DumpDivergenceParams
    metrics = frozenset({DUMP_DIVERGENCE})
    default_resolve_after = 3600.0
    what = "first diverging op"

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        """A hit labelled with the sample's ``op`` (the op to look at first), evidence = its attrs."""
        if not sample.value:
            return None
        op = str(sample.attr("op", "") or "")
        tensor = str(sample.attr("tensor", "") or "")
        return Hit(sample.labels + (("op", op),), f"{self.what}: {op} {tensor}".rstrip(), sample.value,
                   sample.step, sample.source, dict(sample.attrs))
