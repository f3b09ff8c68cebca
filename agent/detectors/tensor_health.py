"""Tensor-health rule kinds on dumped tensors: MindInsight's watchpoints (reference §5) judged on
the statistics the dump scanner gives (docs/tensor-health.md).

Every kind here sees the ``dump_tensor`` samples of :func:`..dumps.watchpoints.tensor_samples`:
one per weight / gradient / activation, then a ``step_end`` marker per (step, rank). A kind
judges each tensor of its ``roles`` and remembers the step's offenders; at the marker (or when a
later step begins) it reports once: label ``tensor`` = the first offender in execution order,
evidence = how many offended and the worst one. So a step with 500 vanishing gradients is one
finding, and alert labels stay bounded.

This module holds the shared base and the kinds that need only the current tensor:
``tensor_too_small``, ``tensor_too_large``, ``tensor_overflow``, ``tensor_all_zero``,
``weight_initialization``. Step-to-step kinds are in tensor_change.py, activation saturation
in tensor_activation.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ..dumps.watchpoints import (DEFAULT_ACTIVATION, DEFAULT_BIAS, DEFAULT_FUNCTIONS, DEFAULT_GRADIENT,
                                 DEFAULT_WEIGHT, DUMP_TENSOR, STEP_END, Classifier, Role, abs_mean, rms)
from ..model import Labels, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params

RoleName = Literal["weight", "gradient", "activation"]
MAX_OPEN_GROUPS = 1000


def _num(s: Sample, key: str) -> float | None:
    v = s.attr(key)
    return None if v is None else float(v)


def dump_step(s: Sample) -> int | None:
    """The dump's training step: an attr, since these samples leave ``Sample.step`` unset (a
    series with steps is watched by ``stalled``, and a dump series has no training progress)."""
    step = s.attr("step", s.step)
    return None if step is None else int(step)


def nonfinite(s: Sample) -> int:
    return int(s.attr("nan") or 0) + int(s.attr("pos_inf") or 0) + int(s.attr("neg_inf") or 0)


class TensorParams(Params):
    """Parameters every tensor kind has: which roles it judges, and the classification regexes
    (``null`` = the defaults of agent/dumps/watchpoints.py, matched on ``name:io:index``)."""

    roles: list[RoleName] = Field(default_factory=lambda: ["weight", "gradient", "activation"])
    include_bias: bool = True
    exclude: list[str] = Field(default_factory=list)
    weight_patterns: list[str] | None = None
    gradient_patterns: list[str] | None = None
    activation_patterns: list[str] | None = None
    bias_patterns: list[str] | None = None
    function_patterns: dict[str, str] | None = None

    @model_validator(mode="after")
    def _regexes(self) -> "TensorParams":
        self.classifier()  # raises ValueError naming the bad list
        return self

    def overrides(self) -> bool:
        return bool(self.exclude) or any(v is not None for v in (
            self.weight_patterns, self.gradient_patterns, self.activation_patterns, self.bias_patterns,
            self.function_patterns))

    def classifier(self) -> Classifier:
        return Classifier(self.exclude, self.gradient_patterns or DEFAULT_GRADIENT,
                          self.weight_patterns or DEFAULT_WEIGHT, self.bias_patterns or DEFAULT_BIAS,
                          self.activation_patterns or DEFAULT_ACTIVATION,
                          self.function_patterns if self.function_patterns is not None else DEFAULT_FUNCTIONS)


class _Group:
    """The offenders of one (series, step) so far."""

    __slots__ = ("step", "first", "count", "worst", "worst_score")

    def __init__(self, step: int | None) -> None:
        self.step = step
        self.first: tuple[Sample, dict[str, Any]] | None = None
        self.count = 0
        self.worst: tuple[Sample, dict[str, Any]] | None = None
        self.worst_score = -math.inf


class TensorKind(Detector[TensorParams]):
    """Base of the tensor kinds: role filtering, per-step grouping, one hit per step."""

    kind: ClassVar[str] = ""
    metrics = frozenset({DUMP_TENSOR})
    default_resolve_after: ClassVar[float] = 3600.0   # dumps come every few hundred steps at most
    what: ClassVar[str] = "tensor"                    # words for the summary

    def __init__(self, params: TensorParams) -> None:
        super().__init__(params)
        self._classifier = params.classifier() if params.overrides() else None
        self._open: OrderedDict[Labels, _Group] = OrderedDict()

    # -- to implement ------------------------------------------------------------------------
    def judge(self, s: Sample, role: Role) -> dict[str, Any] | None:
        """Evidence (with ``value`` and optionally ``score``, larger = worse) if ``s`` offends."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------
    def role_of(self, s: Sample) -> Role | None:
        if self._classifier is not None:
            role = self._classifier.classify(str(s.attr("tensor", "")))
        else:
            role = Role(str(s.attr("role", "other")), str(s.attr("fn") or ""), bool(s.attr("bias")))
        if role.role not in self.params.roles or (role.bias and not self.params.include_bias):
            return None
        return role

    # -- memory across restarts (agent/store/memory.py): the open groups are not PerSeries records ------
    def state(self) -> Any:
        return OrderedDict((labels, {k: getattr(g, k) for k in _Group.__slots__}) for labels, g in self._open.items())

    def restore(self, data: Any) -> None:
        if not isinstance(data, OrderedDict):
            raise ValueError("expected the open groups")
        groups: OrderedDict[Labels, _Group] = OrderedDict()
        for labels, d in list(data.items())[-MAX_OPEN_GROUPS:]:
            if not isinstance(labels, tuple) or not isinstance(d, dict) or set(d) != set(_Group.__slots__):
                raise ValueError("malformed open group")
            g = _Group(d["step"] if d["step"] is None else int(d["step"]))
            g.count, g.worst_score = int(d["count"]), float(d["worst_score"])
            g.first, g.worst = _offender(d["first"]), _offender(d["worst"])
            groups[labels] = g
        self._open = groups

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        self.memory_dirty = True
        if sample.attr("event") == STEP_END:
            return self._flush(sample.labels)
        hit = None
        g = self._open.get(sample.labels)
        step = dump_step(sample)
        if g is not None and g.step != step:
            hit = self._flush(sample.labels)
            g = None
        role = self.role_of(sample)
        if role is None:
            return hit
        ev = self.judge(sample, role)
        if ev is None:
            return hit
        if g is None:
            if len(self._open) >= MAX_OPEN_GROUPS:
                self._open.popitem(last=False)
            g = self._open[sample.labels] = _Group(step)
        g.count += 1
        if g.first is None:
            g.first = (sample, ev)
        score = float(ev.get("score", 0.0))
        if g.worst is None or score > g.worst_score:
            g.worst, g.worst_score = (sample, ev), score
        return hit

    def _flush(self, labels: Labels) -> Hit | None:
        g = self._open.pop(labels, None)
        if g is None or g.first is None or g.worst is None:
            return None
        s, ev = g.first
        tensor = str(s.attr("tensor", ""))
        evidence = {"tensor": tensor, "role": s.attr("role"), "dtype": s.attr("dtype"),
                    "shape": list(s.attr("shape") or ()), "offenders": g.count,
                    **{k: v for k, v in ev.items() if k != "score"}}
        if g.count > 1:
            evidence["worst_tensor"] = str(g.worst[0].attr("tensor", ""))
            evidence["worst_value"] = g.worst[1].get("value")
        more = f" (+{g.count - 1} more)" if g.count > 1 else ""
        msg = f"{self.what}: {tensor}{more}, value {_fmt(ev.get('value'))}"
        value = ev.get("value")
        return Hit(labels + (("tensor", tensor),), msg, float(value) if value is not None else None,
                   g.step, s.source, evidence)


def _offender(v: Any) -> tuple[Sample, dict[str, Any]] | None:
    if v is None:
        return None
    if not (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], Sample) and isinstance(v[1], dict)):
        raise ValueError("malformed offender")
    return v[0], v[1]


def _fmt(v: Any) -> str:
    return format(v, ".6g") if isinstance(v, float) else str(v)


# --- magnitude kinds ------------------------------------------------------------------------------

class MagnitudeParams(TensorParams):
    """MindInsight's *too small* / *too large* parameters; ``mode: any`` hits when one set
    parameter holds (current MindInsight docs), ``all`` when every set one does (older docs)."""

    abs_mean_lt: float | None = Field(None, ge=0)
    abs_mean_gt: float | None = Field(None, ge=0)
    max_lt: float | None = None
    max_gt: float | None = None
    min_lt: float | None = None
    min_gt: float | None = None
    mean_lt: float | None = None
    mean_gt: float | None = None
    mode: Literal["any", "all"] = "any"
    # mean(|x|) is exact where the statistics carry it (the scanner's abs_mean) or the tensor
    # has one sign; otherwise (statistics-only dumps) "conservative" uses the bound that cannot
    # give a false hit (RMS for *_lt, max(|mean|, rms^2/max|x|) for *_gt), "rms" the RMS for both
    abs_mean_estimate: Literal["conservative", "rms"] = "conservative"
    direction: ClassVar[str] = ""

    @model_validator(mode="after")
    def _one_threshold(self) -> "MagnitudeParams":
        names = [f"{k}_{self.direction}" for k in ("abs_mean", "max", "min", "mean")]
        if self.direction and all(getattr(self, n) is None for n in names):
            raise ValueError(f"set at least one of {', '.join(names)}")
        other = "gt" if self.direction == "lt" else "lt"
        wrong = [f"{k}_{other}" for k in ("abs_mean", "max", "min", "mean")
                 if self.direction and getattr(self, f"{k}_{other}") is not None]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: not a parameter of this kind (use the other one)")
        return self


def abs_mean_bounds(s: Sample) -> tuple[float | None, float | None, str]:
    """(lower, upper) bounds of mean(|x|) from the statistics, equal when exact."""
    stats = {k: s.attr(k) for k in ("abs_mean", "min", "max", "mean", "l2norm", "count", "nan", "pos_inf",
                                    "neg_inf")}
    value, how = abs_mean(stats)
    if value is None or how == "exact":
        return value, value, how
    mx = max(abs(float(stats["min"] or 0.0)), abs(float(stats["max"] or 0.0)))
    lower = abs(float(stats["mean"] or 0.0))
    if mx > 0 and math.isfinite(value):
        lower = max(lower, value * value / mx)
    return min(lower, value), value, how


class _Magnitude(TensorKind):
    params_model = MagnitudeParams
    direction: ClassVar[str] = "lt"

    def judge(self, s: Sample, role: Role) -> dict[str, Any] | None:
        p = self.params
        if nonfinite(s) or not s.attr("count"):
            return None  # statistics are over finite elements; NaN/Inf is tensor_overflow's
        d = self.direction
        lo, hi, how = abs_mean_bounds(s)
        am = (hi if d == "lt" else lo) if p.abs_mean_estimate == "conservative" else hi
        checks: list[tuple[str, float | None, float]] = []
        for stat, val in (("abs_mean", am), ("max", _num(s, "max")), ("min", _num(s, "min")),
                          ("mean", _num(s, "mean"))):
            thr = getattr(p, f"{stat}_{d}")
            if thr is not None:
                checks.append((stat, val, thr))
        results = [(stat, val, thr) for stat, val, thr in checks if val is not None
                   and (val < thr if d == "lt" else val > thr)]
        if not results or (p.mode == "all" and len(results) < len(checks)):
            return None
        stat, val, thr = results[0]
        ev: dict[str, Any] = {"statistic": stat, "value": val, "threshold": thr,
                              "abs_mean_basis": how if stat == "abs_mean" else None}
        if how != "exact" and stat == "abs_mean":
            ev["abs_mean_range"] = [lo, hi]
        ratio = (thr / val if d == "lt" else val / thr) if val and thr else math.inf
        ev["score"] = ratio if math.isfinite(ratio) else 1e308
        return ev


class TooSmallParams(MagnitudeParams):
    direction: ClassVar[str] = "lt"
    roles: list[RoleName] = Field(default_factory=lambda: ["gradient"])


class TooLargeParams(MagnitudeParams):
    direction: ClassVar[str] = "gt"
    roles: list[RoleName] = Field(default_factory=lambda: ["gradient"])


class TensorTooSmallDetector(_Magnitude):
    """Gradient vanishing (GV), weight too small (WS), tensor too small (TS)."""

    kind = "tensor_too_small"
    params_model = TooSmallParams
    direction = "lt"
    what = "tensor too small"


class TensorTooLargeDetector(_Magnitude):
    """Gradient too large (GL), weight too large (WL), tensor too large (TL)."""

    kind = "tensor_too_large"
    params_model = TooLargeParams
    direction = "gt"
    what = "tensor too large"


class OverflowParams(TensorParams):
    roles: list[RoleName] = Field(default_factory=lambda: ["gradient"])


class TensorOverflowDetector(TensorKind):
    """NaN/Inf elements: gradient exploding (GE), weight overflow (WO), tensor overflow (TO)."""

    kind = "tensor_overflow"
    params_model = OverflowParams
    what = "NaN/Inf in tensor"

    def judge(self, s: Sample, role: Role) -> dict[str, Any] | None:
        n = nonfinite(s)
        if not n:
            return None
        return {"value": float(n), "nan": s.attr("nan"), "pos_inf": s.attr("pos_inf"),
                "neg_inf": s.attr("neg_inf"), "count": s.attr("count"), "score": float(n)}


def zero_percent(s: Sample) -> float | None:
    """Percentage of zero elements: from ``zero_fraction``, or 100 when the statistics prove every
    element is zero (min = max = 0, no NaN/Inf); otherwise unknown."""
    zf = s.attr("zero_fraction")
    if zf is not None:
        return 100.0 * float(zf)
    if not nonfinite(s) and s.attr("count") and s.attr("min") == 0 and s.attr("max") == 0:
        return 100.0
    return None


class AllZeroParams(TensorParams):
    roles: list[RoleName] = Field(default_factory=lambda: ["gradient", "activation"])
    zero_percentage_ge: float = Field(100.0, ge=0, le=100)
    min_count: int = Field(2, ge=1)


class TensorAllZeroDetector(TensorKind):
    """All-zero tensor (TZ): zero elements >= ``zero_percentage_ge`` percent."""

    kind = "tensor_all_zero"
    params_model = AllZeroParams
    what = "all-zero tensor"

    def judge(self, s: Sample, role: Role) -> dict[str, Any] | None:
        if int(s.attr("count") or 0) < self.params.min_count:
            return None
        pct = zero_percent(s)
        if pct is None or pct < self.params.zero_percentage_ge:
            return None
        return {"value": pct, "zero_percentage": pct, "count": s.attr("count"), "score": pct}


class InitParams(TensorParams):
    roles: list[RoleName] = Field(default_factory=lambda: ["weight"])
    include_bias: bool = False     # zero-initialised biases and LayerNorm betas are the convention
    zero_percentage_ge: float | None = Field(100.0, ge=0, le=100)
    max_gt: float | None = None
    min_lt: float | None = None
    max_step: int = 0              # MindInsight checks step 0 only; dumps without steps are judged

    @field_validator("roles")
    @classmethod
    def _weights(cls, v: list[str]) -> list[str]:
        if v != ["weight"]:
            raise ValueError("weight_initialization judges weights only")
        return v


class WeightInitializationDetector(TensorKind):
    """Weights initialised wrongly (WI): all zero, or out of [min_lt, max_gt], at the first step."""

    kind = "weight_initialization"
    params_model = InitParams
    what = "weight initialised wrongly"

    def judge(self, s: Sample, role: Role) -> dict[str, Any] | None:
        p = self.params
        step = dump_step(s)
        if step is not None and step > p.max_step:
            return None
        pct = zero_percent(s)
        if p.zero_percentage_ge is not None and pct is not None and pct >= p.zero_percentage_ge:
            return {"value": pct, "statistic": "zero_percentage", "threshold": p.zero_percentage_ge, "score": pct}
        mx, mn = _num(s, "max"), _num(s, "min")
        if p.max_gt is not None and mx is not None and mx > p.max_gt:
            return {"value": mx, "statistic": "max", "threshold": p.max_gt, "score": 0.0}
        if p.min_lt is not None and mn is not None and mn < p.min_lt:
            return {"value": mn, "statistic": "min", "threshold": p.min_lt, "score": 0.0}
        return None


__all__ = ["TensorKind", "TensorParams", "abs_mean_bounds", "dump_step", "nonfinite", "rms", "zero_percent"]
