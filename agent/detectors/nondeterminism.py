"""``nondeterminism``: two runs of the same configuration wrote different tensors for the same step.

Ascend's "random error" hunt: dump a run twice and compare bit for bit. Any difference is a finding;
the alert names the first op (in execution order) whose output differs, with its statistics as
evidence. Same shape of alert as ``dump_divergence``, fed by the rerun comparison.
"""

from __future__ import annotations

from ..model import DUMP_NONDETERMINISM
from .dump_incident import IncidentParams
from .dump_divergence import DumpDivergenceDetector



class NondeterminismParams(IncidentParams):
    pass


class NondeterminismDetector(DumpDivergenceDetector):
    kind = "nondeterminism"
    params_model = NondeterminismParams
    metrics = frozenset({DUMP_NONDETERMINISM})
    what = "first op that differs between reruns"
