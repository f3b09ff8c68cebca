"""``loss_scale``'s plans for catching up (``Detector.plan``/``absorb``, agent/detectors/batch.py),
one per condition: a scale that sits where it was, above the floor and the collapse level, with
nothing held, answers None and leaves each condition's memory as it was (bar the last value and
the floor in force); a ratio with no overflow in its window, past warm-up, only notes the steps.
Overflow events and samples with attributes (a producer's own back-off message) are observed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..model import LEARNING_RATE, LOSS, LOSS_SCALE, Labels
from .batch import RunView, first_true

if TYPE_CHECKING:
    from .loss_scale import LossScaleDetector

_STEPPED = frozenset({LOSS, LEARNING_RATE, LOSS_SCALE})  # overflow_ratio: values that only note their step


def plan(det: "LossScaleDetector", labels: Labels, run: RunView, metrics: frozenset[str]) -> int:
    from .loss_scale import _OBSERVE  # (imported here: loss_scale imports this module)
    if type(det).observe is not _OBSERVE:
        return 0  # observe was replaced: that is what is asked, sample by sample
    cond = det.params.condition
    if cond == "overflow_ratio":
        return _ratio_plan(det, labels, run, metrics)
    at = run.first(metrics - {LOSS_SCALE})
    if LOSS_SCALE not in metrics:
        return at
    first = run.at(LOSS_SCALE, 0)
    t = det._tracks.value(labels)
    v = run.values(LOSS_SCALE)
    sample = run.samples[first]
    if cond == "floor":
        if t is None:
            return min(at, first)
        if t.active or t.announcing or run.producer() is None:
            return min(at, first)
        floor = det.floor_for(sample)[0]
        if det.params.floor == "auto" and t.announced is not None and t.announced > floor:
            floor = t.announced
        k = first_true(v <= floor)
    else:
        at = min(at, run.with_attrs(LOSS_SCALE))
        if t is None or t.active or t.last is None:
            return min(at, first)
        if cond == "collapse":
            if run.producer() is None:
                return min(at, first)
            k = first_true(np.isfinite(v) & ((v != t.last) | ~(v > det.collapse_level(sample))))
        else:  # decreases, jump: the same value again, nothing held
            if t.decreases:
                return min(at, first)
            k = first_true(v != t.last)
    return at if k is None else min(at, run.at(LOSS_SCALE, k))


def absorb(det: "LossScaleDetector", labels: Labels, run: RunView, metrics: frozenset[str], upto: int) -> None:
    cond = det.params.condition
    samples = run.samples
    if cond == "overflow_ratio":
        # the samples of each metric before ``upto`` (together: every sample that notes a step)
        seen = [idx for idx in (run.index(m)[:run.count_before(m, upto)] for m in metrics & _STEPPED) if len(idx)]
        if not seen:
            return
        t = det._tracks.get(labels)
        # one at a time, each step other than the one judged last becomes it and may start the
        # span (the plan made sure every one has a step; the last judged is no lower than the start)
        low = min(min(run.pick("step", idx)) for idx in seen)
        if low != t.judged_step and (t.span_start is None or low < t.span_start):
            t.span_start = low
            t.overflows.clear()
            t.skipped = 0.0
        t.judged_step = run.column("step")[max(idx[-1] for idx in seen)]
        return
    k = run.count_before(LOSS_SCALE, upto) if LOSS_SCALE in metrics else 0
    if not k:
        return
    last = samples[run.index(LOSS_SCALE)[k - 1]]
    if cond == "floor":
        t = det._tracks.get(labels)
        floor, source = det.floor_for(last)
        if det.params.floor == "auto" and t.announced is not None and t.announced > floor:
            floor, source = t.announced, "announced by the producer"
        t.floor, t.floor_source = floor, source
    elif cond == "collapse":
        vals = run.values(LOSS_SCALE)[:k]
        fin = np.flatnonzero(np.isfinite(vals))
        if fin.size:
            det._tracks.get(labels).last = samples[run.index(LOSS_SCALE)[int(fin[-1])]].value
    else:
        det._tracks.get(labels)


def _ratio_plan(det: "LossScaleDetector", labels: Labels, run: RunView, metrics: frozenset[str]) -> int:
    """Past warm-up, nothing held and no overflow in the window: a value of a record with a
    step only notes it (judged_step, the span's start); an overflow event is observed."""
    at = run.first(metrics - _STEPPED)
    stepped = metrics & _STEPPED
    first = run.first(stepped)
    if first >= run.n:
        return at
    t = det._tracks.value(labels)
    if t is None or t.warm or t.active or t.overflows or t.skipped != 0:
        return min(at, first)
    return min(at, run.first_none("step", stepped))
