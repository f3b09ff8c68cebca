"""Step-to-step weight kinds: ``weight_not_changed`` (MindInsight WNC) and ``weight_change``
(WCL / WCS: the update ratio too large or too small).

Both compare a weight with the same weight (same series, same ``name:io:index``) at the
previous dumped step, and report a weight only once the condition held on ``for_steps``
comparisons in a row (comparisons ending before ``after_step`` are not judged). Memory is bounded: per rule at most ``max_tensors`` weights are
remembered (least recently seen dropped first), each as its statistics plus the sketch of
:mod:`..dumps.watchpoints` (``SKETCH_SIZE`` elements at fixed positions) when the dump had data.

With sketches the comparison is MindInsight's, on the sampled elements: unchanged when every
element satisfies ``|cur - prev| <= atol + rtol*|prev|``; update ratio
``mean|cur - prev| / (mean|prev| + epsilon)``. With statistics only:
* unchanged when min, max and mean each move by at most ``atol + rtol*|prev|`` and the L2 norm
  by at most ``atol*sqrt(n) + rtol*norm`` (a necessary condition of elementwise allclose);
* the ratio has a lower bound, ``max(|dmean|, drms^2 / (max|cur| + max|prev|)) / (rms_prev + eps)``
  (mean|d| >= |mean d|, mean|d| >= rms(d)^2/max|d|, rms(d) >= |drms|, mean|prev| <= rms_prev), so
  *too large* never hits falsely; *too small* needs an upper bound that statistics cannot give,
  so it is judged only with sketches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from ..model import Sample
from ..dumps.watchpoints import Role
from .base import PerSeries
from .tensor_health import RoleName, TensorKind, TensorParams, dump_step, nonfinite

LB_NOISE = 1e-6   # statistics' lower bounds below this are fp32 rounding, not a change
_STATS = ("min", "max", "mean", "l2norm", "count", "nan", "pos_inf", "neg_inf")


@dataclass(slots=True)
class _Prev:
    """A weight at its previous dumped step (one persisted row per weight: see ``_ChangeKind``)."""

    step: int | None = None
    stats: dict = field(default_factory=dict)
    sketch: np.ndarray | None = None
    streak: int = 0      # comparisons in a row (up to this step) that met the condition


_TENSOR = "__tensor__"  # the key of a weight's memory: its series labels plus this pair


class ChangeParams(TensorParams):
    roles: list[RoleName] = Field(default_factory=lambda: ["weight"])
    max_tensors: int = Field(4096, ge=1, le=1_000_000)
    # the condition must hold on this many step-to-step comparisons of a weight in a row: one
    # skipped update (a loss scaler's overflow step) or one step at a warm-up's lr 0 is no finding
    for_steps: int = Field(1, ge=1, le=1000)
    # comparisons that end before this step are not judged (a learning-rate warm-up)
    after_step: int = Field(0, ge=0)


class _ChangeKind(TensorKind):
    """Remembers each weight's previous step and judges the pair."""

    def __init__(self, params: ChangeParams) -> None:
        super().__init__(params)
        # keyed like series memory, so the state store writes one row per weight a dump changed
        # (a whole-map blob of 4096 weights with their sketches was ~12 MB per commit)
        self._prev: PerSeries[_Prev] = PerSeries(_Prev, cap=params.max_tensors)

    def compare(self, s: Sample, cur: dict[str, Any], prev: _Prev) -> dict[str, Any] | None:
        raise NotImplementedError

    def judge(self, s: Sample, role: Role) -> dict[str, Any] | None:
        key = s.labels + ((_TENSOR, str(s.attr("tensor", ""))),)
        cur = {k: s.attr(k) for k in _STATS}
        sk = s.attr("sketch")
        step = dump_step(s)
        seen = self._prev.peek(key)
        if seen is not None and step is not None and seen.step is not None and step <= seen.step:
            return None  # the same or an older step again (a rescan): nothing to compare
        prev = None if seen is None else _Prev(seen.step, seen.stats, seen.sketch, seen.streak)
        rec = self._prev.get(key)  # most recently seen; the least recently seen go past the cap
        rec.step, rec.stats, rec.sketch = step, cur, sk if isinstance(sk, np.ndarray) else None
        rec.streak = 0
        if prev is None or prev.stats.get("count") != cur["count"]:
            return None  # first sighting, or the shape changed (another tensor under the same name)
        if step is not None and step < self.params.after_step:
            return None
        ev = self.compare(s, cur, prev)
        if ev is None:
            return None
        rec.streak = prev.streak + 1
        if rec.streak < self.params.for_steps:
            return None
        ev["previous_step"] = prev.step
        ev["steps_in_a_row"] = rec.streak
        return ev


def _sketches(s: Sample, prev: _Prev) -> tuple[np.ndarray, np.ndarray] | None:
    cur = s.attr("sketch")
    if isinstance(cur, np.ndarray) and prev.sketch is not None and cur.shape == prev.sketch.shape and cur.size:
        return cur, prev.sketch
    return None


class NotChangedParams(ChangeParams):
    rtol: float = Field(1e-5, ge=0)
    atol: float = Field(1e-8, ge=0)
    equal_nan: bool = False


class WeightNotChangedDetector(_ChangeKind):
    """A weight equal (allclose) to itself at the previous dumped step: frozen, or lr = 0."""

    kind = "weight_not_changed"
    params_model = NotChangedParams
    what = "weight not changed"

    def compare(self, s: Sample, cur: dict[str, Any], prev: _Prev) -> dict[str, Any] | None:
        p = self.params
        pair = _sketches(s, prev)
        if pair is not None:
            c, q = pair
            if not np.allclose(c, q, rtol=p.rtol, atol=p.atol, equal_nan=p.equal_nan):
                return None
            return {"value": float(np.max(np.abs(c - q), initial=0.0, where=np.isfinite(c - q))),
                    "basis": "sampled_elements", "elements": int(c.size), "rtol": p.rtol, "atol": p.atol}
        if (nonfinite(s) and not p.equal_nan) or any(cur[k] != prev.stats[k] for k in ("nan", "pos_inf", "neg_inf")):
            return None
        worst = 0.0
        n = int(cur["count"] or 0)
        for k in ("min", "max", "mean", "l2norm"):
            a, b = cur[k], prev.stats[k]
            if a is None or b is None:
                if a is not b:
                    return None
                continue
            tol = (p.atol * math.sqrt(n) if k == "l2norm" else p.atol) + p.rtol * abs(b)
            if not abs(a - b) <= tol:
                return None
            worst = max(worst, abs(a - b))
        return {"value": worst, "basis": "statistics", "rtol": p.rtol, "atol": p.atol}


class ChangeRatioParams(ChangeParams):
    include_bias: bool = False     # a zero-initialised bias has an infinite ratio at its first update
    abs_mean_update_ratio_gt: float | None = Field(None, ge=0)
    abs_mean_update_ratio_lt: float | None = Field(None, ge=0)
    epsilon: float = Field(1e-9, ge=0)

    @model_validator(mode="after")
    def _one(self) -> "ChangeRatioParams":
        if self.abs_mean_update_ratio_gt is None and self.abs_mean_update_ratio_lt is None:
            raise ValueError("set abs_mean_update_ratio_gt (too large) or abs_mean_update_ratio_lt (too small)")
        return self


def _rms(st: dict[str, Any]) -> float | None:
    n = int(st.get("count") or 0) - int(st.get("nan") or 0) - int(st.get("pos_inf") or 0) - int(st.get("neg_inf") or 0)
    if st.get("l2norm") is None or n <= 0:
        return None
    return float(st["l2norm"]) / math.sqrt(n)


def ratio_lower_bound(cur: dict[str, Any], prev: dict[str, Any], eps: float) -> float | None:
    """A lower bound of mean|cur - prev| / (mean|prev| + eps) from statistics alone."""
    rc, rp = _rms(cur), _rms(prev)
    if rc is None or rp is None or None in (cur.get("mean"), prev.get("mean")):
        return None
    num = abs(float(cur["mean"]) - float(prev["mean"]))
    span = sum(max(abs(float(st.get("min") or 0.0)), abs(float(st.get("max") or 0.0))) for st in (cur, prev))
    if span > 0:
        num = max(num, (rc - rp) ** 2 / span)
    den = rp + eps
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else (math.inf if num > 0 else 0.0)


class WeightChangeDetector(_ChangeKind):
    """The update ratio mean|cur - prev| / (mean|prev| + epsilon) above ``abs_mean_update_ratio_gt``
    (WCL: the step was too big) or below ``abs_mean_update_ratio_lt`` (WCS: barely training)."""

    kind = "weight_change"
    params_model = ChangeRatioParams
    what: ClassVar[str] = "weight update ratio out of range"

    def compare(self, s: Sample, cur: dict[str, Any], prev: _Prev) -> dict[str, Any] | None:
        p = self.params
        pair = _sketches(s, prev)
        lb = ratio_lower_bound(cur, prev.stats, p.epsilon)
        basis: Literal["sampled_elements", "statistics_lower_bound"]
        if pair is not None:
            c, q = pair
            d, base = np.abs(c - q), float(np.abs(q).mean())
            if not np.all(np.isfinite(d)) or not math.isfinite(base):
                ratio = math.inf
            else:
                ratio = float(d.mean()) / (base + p.epsilon) if base + p.epsilon > 0 else \
                    (math.inf if d.any() else 0.0)
            basis = "sampled_elements"
            # a change the sampled elements missed (one huge value); not the rounding of fp32
            # statistics (a mean is good to ~1e-7 of the weight's size: below that it is noise)
            if lb is not None and lb > max(2 * ratio, LB_NOISE):
                ratio, basis = lb, "statistics_lower_bound"
        elif lb is not None:
            ratio, basis = lb, "statistics_lower_bound"
        else:
            return None
        ev = {"value": ratio, "ratio": ratio, "basis": basis, "epsilon": p.epsilon}
        if p.abs_mean_update_ratio_gt is not None and ratio > p.abs_mean_update_ratio_gt:
            return {**ev, "condition": "too_large", "threshold": p.abs_mean_update_ratio_gt,
                    "score": ratio if math.isfinite(ratio) else 1e308}
        # ratio 0 (no change at all) is left to weight_not_changed, so one cause raises one alert
        if p.abs_mean_update_ratio_lt is not None and basis == "sampled_elements" \
                and 0 < ratio < p.abs_mean_update_ratio_lt:
            return {**ev, "condition": "too_small", "threshold": p.abs_mean_update_ratio_lt,
                    "score": -ratio}
        return None
