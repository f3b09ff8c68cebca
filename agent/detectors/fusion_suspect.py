"""``fusion_suspect``: the first bad op of a dump (NaN/Inf from finite inputs, the first op that
overflowed when none turned NaN/Inf, or the first op that lost precision against the benchmark)
is a fused API or an op a fusion pass made.

The dump side names the op and asks agent/fusion/suspect.py whether it is fused; the answer rides
on the ``dump_nonfinite`` / ``dump_overflow`` / ``dump_divergence`` sample as ``fusion_*`` attributes, and this kind
turns it into an alert labelled with the op, whose evidence carries the passes (with the
``fusion_switch.cfg`` that turns off exactly them) or the fused API and how to run it unfused.
"""

from __future__ import annotations

import json
from typing import Literal

from ..model import DUMP_DIVERGENCE, DUMP_NONFINITE, DUMP_OVERFLOW, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params


class FusionSuspectParams(Params):
    on: list[Literal["nonfinite", "overflow", "divergence"]] = ["nonfinite", "overflow", "divergence"]


_METRIC = {"nonfinite": DUMP_NONFINITE, "overflow": DUMP_OVERFLOW, "divergence": DUMP_DIVERGENCE}
_WHY = {DUMP_NONFINITE: "produced NaN/Inf from finite inputs", DUMP_OVERFLOW: "overflowed first",
        DUMP_DIVERGENCE: "lost precision first"}


def _names(v: object) -> list[str]:
    """A list attribute (a rule test's ``attrs`` give it as one comma-separated string)."""
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    return [str(x) for x in v] if isinstance(v, (list, tuple)) else []


def _switch_file(passes: list[str], cfg: str | None) -> str:
    """The annotation's sentence on ``fusion_switch.cfg``: the ready file itself, as JSON."""
    if cfg is not None:
        return f"The fusion_switch.cfg that turns off exactly {'it' if len(passes) == 1 else 'them'}: {cfg}"
    if passes:
        return "No ready fusion_switch.cfg: it needs the job's fusion_result.json (GraphFusion or UBFusion)"
    return "A fused API has no fusion_switch.cfg: run the unfused path as said"


class FusionSuspectDetector(Detector[FusionSuspectParams]):
    kind = "fusion_suspect"
    params_model = FusionSuspectParams
    metrics = frozenset(_METRIC.values())

    def wanted_metrics(self) -> frozenset[str]:
        return frozenset(_METRIC[o] for o in self.params.on)

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        kind = sample.attr("fusion_kind")
        if not kind:
            return None
        op = str(sample.attr("op", ""))
        passes = _names(sample.attr("fusion_passes"))
        api = sample.attr("fusion_api")
        cfg = sample.attr("fusion_switch_cfg")
        what = f"fusion passes {', '.join(passes)}" if passes else f"fused API {api}"
        why = _WHY[sample.metric]
        evidence = {"op": op, "kind": kind, "api": api, "passes": passes, "suspects": ", ".join(passes) or api,
                    "advice": sample.attr("fusion_advice") or "",
                    "switch_cfg": json.loads(cfg) if isinstance(cfg, str) else None,
                    "switch_cfg_json": cfg if isinstance(cfg, str) else "",
                    "switch_file": _switch_file(passes, cfg if isinstance(cfg, str) else None),
                    "fused_ops": _names(sample.attr("fusion_fused_ops")),   # across fusion: the calls inside the module
                    "tensor": sample.attr("tensor"), "rank": sample.attr("rank"), "found_by": sample.metric}
        return Hit(sample.labels + (("op", op),), f"{op} {why}; it is fused ({what})", sample.value,
                   sample.step, sample.source, evidence)
