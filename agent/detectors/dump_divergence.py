"""``dump_divergence``: a step's dump no longer matches the benchmark run's dump of the same step.

The daemon compares a watched dump directory with its configured benchmark (agent/compare) when
both sides of a step are complete; every comparison becomes one sample (value 1: diverged, 0:
matched). This kind keeps one incident per run (agent/detectors/dump_incident.py): the first
diverging step is its origin, with the op that lost precision; later steps that diverge (because
the earlier one did) are counted into it; ``clean_steps`` matching steps end it. The full
comparison table stays in the JSON API and a CSV file.
"""

from __future__ import annotations

from ..model import DUMP_DIVERGENCE, Sample
from .base import Clear, Hit
from .dump_incident import IncidentKind, IncidentParams


class DumpDivergenceParams(IncidentParams):
    pass


class DumpDivergenceDetector(IncidentKind[DumpDivergenceParams]):
    kind = "dump_divergence"
    params_model = DumpDivergenceParams
    metrics = frozenset({DUMP_DIVERGENCE})
    what = "first diverging op"
    zero_is_clean = True

    def bad(self, sample: Sample) -> list[Hit | Clear]:
        return self.incidents.bad(sample, self.what, dict(sample.attrs))
