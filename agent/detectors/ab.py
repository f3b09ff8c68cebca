"""``ab``: two runs that differ in one label, compared on the training curves they share.

Ascend's accuracy guide settles "did operator fusion cause it?" by training again with fusion
off and asking whether accuracy clearly improved. This kind asks that of two series that differ
only in the label ``by`` (default ``fusion``): the ``suspect`` side (``on``) against the
``reference`` side (``off``), over the steps both reached. The same kind with another label (e.g.
``by: attempt`` or ``by: seed``) is the "run it twice" check on curves.

Verdicts (``judge``, shared with ``precision-agent fusion ab``):

* ``fusion_suspected``: the suspect run is clearly worse: a NaN/Inf loss (or the trainer saying
  so), or a loss-scale collapse, that the reference run did not have by the same step; or a loss
  gap beyond noise in *both* halves of the last ``2 x window`` common steps: in each half the
  median of the per-step differences is above ``min_gap`` of the reference loss and above three
  standard errors of that median (from the differences' spread), *and* a sign test says the
  suspect side is higher on more steps than chance allows (one-sided binomial, ``alpha``). One
  noisy step moves neither the medians nor the sign counts, so it never decides; two independent
  halves at ``alpha`` each keep a verdict judged at every new step from firing on noise.
* ``fusion_off_worse``: the same, the other way round.
* ``no_difference``: enough common steps and neither test holds (or both sides broke).
* ``insufficient_data``: fewer than ``min_steps`` common steps with a finite loss on both sides.

Steps are the trainer's step numbers; for producers that print none (HF Trainer), the n-th loss
report of each run stands for its step n. A state kind: hits while the verdict is
``fusion_suspected`` (alert labels: the pair's labels without ``by``), clears when it is no longer.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from pydantic import Field

from ..model import GRAD_NORM, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, Labels, Sample
from ..series.state import SeriesState
from .base import Clear, Detector, Hit, Params, PerSeries
from .loss_scale import COLLAPSE_LEVELS, DEFAULT_COLLAPSE

# labels a pair's two runs may differ in besides ``by``: the agent names each followed file's run
PAIR_FREE = ("run",)

Verdict = Literal["fusion_suspected", "no_difference", "fusion_off_worse", "insufficient_data"]


class AbParams(Params):
    by: str = "fusion"               # the label whose values tell the two runs apart
    suspect: str = "on"              # the side suspected (fusion on)
    reference: str = "off"           # the side it is held against (fusion off)
    window: int = Field(50, ge=3, le=1000)  # each of the two halves of common steps compared
    min_steps: int = Field(20, ge=3)  # common steps needed before any verdict on the loss gap
    min_gap: float = Field(0.02, ge=0)   # relative median loss gap that counts (2 %)
    alpha: float = Field(0.001, gt=0, lt=0.5)  # sign-test significance, in each half
    max_points: int = Field(4096, ge=16)  # losses kept per side (the latest)


class Curve(NamedTuple):
    """One side as the judgement needs it."""

    loss: dict[int, float]       # step -> finite loss
    bad: tuple[int, str] | None  # first step of a NaN/Inf loss or a collapse, and which
    top: int | None              # the highest step seen


@dataclass
class AbResult:
    verdict: Verdict
    steps_compared: int
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "steps_compared": self.steps_compared, "evidence": self.evidence}


def _tail_p(n: int, k: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2): how likely k or more of n signs are positive by chance."""
    if k <= 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(k, n + 1)) / (1 << n)  # exact: no float overflow


def _half(diffs: list[float], level: float) -> dict[str, Any]:
    med = statistics.median(diffs)
    mad = statistics.median(abs(d - med) for d in diffs)
    se = 1.4826 * mad * 1.2533 / math.sqrt(len(diffs))  # the median's standard error, robustly
    pos = sum(d > 0 for d in diffs)
    neg = sum(d < 0 for d in diffs)
    return {"median": med, "relative": med / level, "se": se, "pos": pos, "neg": neg,
            "p_worse": _tail_p(pos + neg, pos), "p_better": _tail_p(pos + neg, neg)}


def _broke_first(a: Curve, b: Curve) -> bool:
    """``a`` broke at a step ``b`` reached without breaking."""
    if a.bad is None or b.top is None or b.top < a.bad[0]:
        return False
    return b.bad is None or b.bad[0] > a.bad[0]


def judge(suspect: Curve, reference: Curve, p: AbParams, common: list[int] | None = None) -> AbResult:
    """The verdict; ``common`` (the steps both sides have, in order) when the caller keeps it."""
    if _broke_first(suspect, reference):
        return AbResult("fusion_suspected", 0, {"check": suspect.bad[1], "suspect_step": suspect.bad[0],
                                                "reference_reached": reference.top})
    if _broke_first(reference, suspect):
        return AbResult("fusion_off_worse", 0, {"check": reference.bad[1], "reference_step": reference.bad[0],
                                                "suspect_reached": suspect.top})
    if common is None:
        common = sorted(set(suspect.loss) & set(reference.loss))
    else:
        common = [c for c in common if c in suspect.loss and c in reference.loss]
    return judge_gap(common, suspect, reference, p)


def judge_gap(common: list[int], suspect: Curve, reference: Curve, p: AbParams) -> AbResult:
    """The loss-gap test over the common steps (in order)."""
    if len(common) < p.min_steps:
        return AbResult("insufficient_data", len(common), {"min_steps": p.min_steps})
    steps = common[-2 * p.window:]
    mid = len(steps) // 2
    level = statistics.median(abs(reference.loss[s]) for s in steps) or 1.0
    halves = [_half([suspect.loss[s] - reference.loss[s] for s in part], level)
              for part in (steps[:mid], steps[mid:])]
    evidence = {"check": "loss_gap", "from_step": steps[0], "to_step": steps[-1],
                "median_gap": halves[1]["median"], "relative_gap": round(halves[1]["relative"], 6),
                "relative_gaps": [round(h["relative"], 6) for h in halves],
                "suspect_higher": sum(h["pos"] for h in halves), "reference_higher": sum(h["neg"] for h in halves),
                "p_suspect_worse": [round(h["p_worse"], 8) for h in halves],
                "p_reference_worse": [round(h["p_better"], 8) for h in halves],
                "min_gap": p.min_gap, "alpha": p.alpha}
    if all(h["relative"] > p.min_gap and h["median"] > 3 * h["se"] and h["p_worse"] < p.alpha for h in halves):
        return AbResult("fusion_suspected", len(steps), evidence)
    if all(h["relative"] < -p.min_gap and -h["median"] > 3 * h["se"] and h["p_better"] < p.alpha for h in halves):
        return AbResult("fusion_off_worse", len(steps), evidence)
    return AbResult("no_difference", len(steps), evidence)


def detail(r: AbResult, p: AbParams) -> str:
    """The verdict in words, for the alert's annotations (a break, or the loss gap)."""
    e = r.evidence
    on, off = f"{p.by}={p.suspect}", f"{p.by}={p.reference}"
    if "suspect_step" in e:
        return (f"with {on} the run had {e['check']} at step {e['suspect_step']}; with {off} it reached step "
                f"{e['reference_reached']} without it")
    return (f"over the last {r.steps_compared} common steps ({e['from_step']}..{e['to_step']}) the loss with {on} "
            f"is higher by a median {e['relative_gap'] * 100:.3g} % (above {p.min_gap * 100:.3g} %): higher on "
            f"{e['suspect_higher']} of them, lower on {e['reference_higher']} (sign test p "
            f"{max(e['p_suspect_worse']):.2g} < {p.alpha:g} in each half)")


@dataclass
class _Pair:
    """Both sides of one pair (flat fields: the memory codec stores plain records)."""

    loss_s: dict = field(default_factory=dict)
    loss_r: dict = field(default_factory=dict)
    bad_s: list = field(default_factory=list)   # [step, what] once the side broke
    bad_r: list = field(default_factory=list)
    top_s: int = -1
    top_r: int = -1
    n_s: int = 0                                # loss reports so far (the step of step-less logs)
    n_r: int = 0
    common: list = field(default_factory=list)  # steps with a loss on both sides, in arrival order
    active: bool = False


def take(sample: Sample, series: SeriesState, side: dict[str, Any], max_points: int) -> int | bool:
    """Add one sample to a side (``loss``, ``bad``, ``top``, ``n`` as in ``_Pair``); returns the step
    of a loss it added, True for a break, False when nothing the verdict depends on changed."""
    m = sample.metric
    if m == LOSS:
        side["n"] += 1
    step = sample.step if sample.step is not None else (side["n"] if m == LOSS else None)
    if step is None:
        step = series.last_step if series.last_step is not None else side["n"]
    if step > side["top"]:
        side["top"] = step
    what = None
    if m == LOSS and not math.isfinite(sample.value):
        what = "nonfinite_loss"
    elif m == NONFINITE_MESSAGE:
        what = "nonfinite_loss"
    elif m == GRAD_NORM and not math.isfinite(sample.value) and series.loss_scaling == "no":
        what = "nonfinite_grad_norm"
    elif m == LOSS_SCALE and series.scale_decreases and sample.value <= COLLAPSE_LEVELS.get(
            sample.producer, DEFAULT_COLLAPSE):
        what = "loss_scale_collapse"
    if what is not None:
        if not side["bad"]:
            side["bad"][:] = [step, what]
            return True
        return False
    if m == LOSS:
        loss = side["loss"]
        new = step not in loss
        loss[step] = sample.value
        while len(loss) > max_points:
            del loss[next(iter(loss))]
        return step if new else False
    return False


def curve(side: dict[str, Any]) -> Curve:
    bad = side["bad"]
    return Curve(side["loss"], (bad[0], bad[1]) if bad else None, side["top"] if side["top"] >= 0 else None)


def new_side() -> dict[str, Any]:
    return {"loss": {}, "bad": [], "top": -1, "n": 0}


class AbDetector(Detector[AbParams]):
    kind = "ab"
    params_model = AbParams
    metrics = frozenset({LOSS, GRAD_NORM, LOSS_SCALE, NONFINITE_MESSAGE})
    stateful = True

    def __init__(self, params: AbParams) -> None:
        super().__init__(params)
        self._pairs: PerSeries[_Pair] = PerSeries(_Pair)

    def observe(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        p = self.params
        which = None
        for k, v in sample.labels:
            if k == p.by:
                which = v
        if which not in (p.suspect, p.reference):
            return None
        group: Labels = tuple(kv for kv in sample.labels if kv[0] != p.by and kv[0] not in PAIR_FREE)
        pair = self._pairs.get(group)
        tag = "s" if which == p.suspect else "r"
        side = self._side(pair, tag)
        before = side["top"]
        changed = take(sample, series, side, p.max_points)
        setattr(pair, "top_" + tag, side["top"])
        setattr(pair, "n_" + tag, side["n"])
        # the other side's break (NaN/Inf, collapse) that this side has now reached: judge anew,
        # whatever this sample is (a run ahead breaks before the other run gets there)
        other_bad = pair.bad_r if tag == "s" else pair.bad_s
        reached = bool(other_bad) and before < other_bad[0] <= side["top"]
        if changed is False and not reached:
            return None
        s_curve, r_curve = curve(self._side(pair, "s")), curve(self._side(pair, "r"))
        other = r_curve if tag == "s" else s_curve
        if changed is not True and changed is not False and changed in other.loss:
            pair.common.append(changed)
            if len(pair.common) > 4 * p.window:
                del pair.common[:len(pair.common) - 2 * p.window]
        elif changed is not True and not reached:
            return None  # not a common step yet: nothing to compare anew
        result = judge(s_curve, r_curve, p, None if changed is True else pair.common)
        if result.verdict != "fusion_suspected":
            if pair.active:
                pair.active = False
                return Clear(group)
            return None
        pair.active = True
        ev = result.to_json()
        what = ev["evidence"].get("check")
        message = (f"with {p.by}={p.suspect} the run is clearly worse than with {p.by}={p.reference} "
                   f"({what}, {result.steps_compared} common steps)")
        return Hit(group, message, ev["evidence"].get("relative_gap"), sample.step, sample.source,
                   {"verdict": result.verdict, "steps_compared": result.steps_compared, "by": p.by,
                    "suspect": p.suspect, "reference": p.reference, **ev["evidence"],
                    "detail": detail(result, p)})

    @staticmethod
    def _side(pair: _Pair, tag: str) -> dict[str, Any]:
        return {"loss": getattr(pair, "loss_" + tag), "bad": getattr(pair, "bad_" + tag),
                "top": getattr(pair, "top_" + tag), "n": getattr(pair, "n_" + tag)}
