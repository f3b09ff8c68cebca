"""``activation_range``: saturated tanh / sigmoid outputs and dead ReLUs (MindInsight AR).

MindInsight's recommended watchpoints count the elements inside a range, which needs the data:
tanh: fewer than 0.1 % of outputs in [tanh(-8.8), tanh(8.8)]; sigmoid: fewer than 0.1 % in
[sigmoid(-16.2), sigmoid(16.2)]; ReLU: more than 99.9 % in [-1, 0]. From statistics:

* tanh and sigmoid: the mean local gradient of the activation, relative to its maximum, is
  exact from mean and RMS: tanh' = 1 - y^2, so mean(tanh') = 1 - rms^2; sigmoid' = y(1 - y), so
  mean(sigmoid') = mean - rms^2, divided by its maximum 1/4. MindInsight's condition implies a
  relative gradient below 0.001 + 4e-7, so ``max_relative_gradient`` = 1e-3 hits whenever it does
  (and also on outputs all near, not beyond, the cut-off: just as saturated for training).
* ReLU: outputs are >= 0, so "in [-1, 0]" means exactly zero: ``zero_fraction`` >= 99.9 %.
  Without a zero count (msprobe statistics mode) only max = 0 (every output zero) is provable.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..dumps.watchpoints import Role
from ..model import Sample
from .tensor_health import RoleName, TensorKind, TensorParams, nonfinite, rms, zero_percent

_MAX_GRADIENT = {"tanh": 1.0, "sigmoid": 0.25}


class ActivationParams(TensorParams):
    roles: list[RoleName] = Field(default_factory=lambda: ["activation"])
    functions: list[str] = Field(default_factory=lambda: ["tanh", "sigmoid", "relu"])
    max_relative_gradient: float = Field(1e-3, ge=0, le=1)
    dead_percentage_ge: float = Field(99.9, ge=0, le=100)
    min_count: int = Field(2, ge=1)


class ActivationRangeDetector(TensorKind):
    kind = "activation_range"
    params_model = ActivationParams
    what = "saturated activation"

    def judge(self, s: Sample, role: Role) -> dict[str, Any] | None:
        p = self.params
        if role.fn not in p.functions or nonfinite(s) or int(s.attr("count") or 0) < p.min_count:
            return None
        if role.fn == "relu":
            pct = zero_percent(s)
            if pct is None or pct < p.dead_percentage_ge:
                return None
            return {"value": pct, "function": "relu", "condition": "dead", "zero_percentage": pct,
                    "threshold": p.dead_percentage_ge, "score": pct}
        if role.fn not in _MAX_GRADIENT:
            return None
        r = rms({k: s.attr(k) for k in ("l2norm", "count", "nan", "pos_inf", "neg_inf")})
        mean = s.attr("mean")
        if r is None or (role.fn == "sigmoid" and mean is None):
            return None
        grad = 1.0 - r * r if role.fn == "tanh" else float(mean) - r * r
        rel = max(0.0, grad) / _MAX_GRADIENT[role.fn]
        if rel > p.max_relative_gradient:
            return None
        return {"value": rel, "function": role.fn, "condition": "saturated", "relative_gradient": rel,
                "threshold": p.max_relative_gradient, "score": -rel}
