"""``loss_scale``: dynamic loss scaling that has collapsed or misbehaves.

One rule judges one ``condition`` (the shipped file has one rule per condition):

* ``floor``: a dynamic scaler came down to its floor, or a run known to train in fp16 sits at it.
  A scale that never moved, with no overflow or skip, in a run of unknown precision (Megatron
  prints ``loss scale: 1.0`` on every bf16 iteration) or of bf16/fp32, is not a dynamic loss scale
  at its floor and is not judged (docs/rules.md, "Precision mode"). Hits on every observation at
  the floor (and on an overflow while there), clears on the first one above it. ``floor: auto`` (the default) takes the floor of the ``framework``
  when one is set, else of the producer that printed the value (the series' detected log
  format): fairseq's scaler goes down to ``--min-loss-scale`` (default 1e-4) and stops training
  there, so a fairseq scale of 1 or 0.5 is ordinary; TF/NPU and MindSpore clamp at 1, and
  DeepSpeed/Megatron default to a minimum of 1, while PyTorch's GradScaler and apex have no
  clamp, so for them and for unknown producers reaching 1 is already abnormal (floor 1). When
  fairseq announces ``Minimum loss scale reached (X)``, X becomes that series' floor.
* ``decreases``: ``min_decreases`` or more decreases within ``window`` steps with no increase in
  between, after warm-up. A decrease is counted as the number of ``decrease_factor`` back-offs it
  implies (Megatron prints one value per log interval, so 8192 -> 2048 between two reports is two
  halvings). Clears at the next increase or when the decreases age out of the window.
* ``overflow_ratio``: overflow (skipped) steps / steps over the last ``window`` steps above
  ``max_overflow_ratio``, after warm-up, once at least ``min_steps`` steps were seen. Clears when
  the ratio falls back to the threshold or below.
* ``collapse``: ``min_backoffs`` or more back-offs in a row, with no growth in between, that took
  the scale down to ``collapse_below`` or lower, deep below where healthy runs settle. No warm-up
  and no step numbers are needed: a warm-up back-off run that ends there is a collapse too.
  ``collapse_below: auto`` is 8 (2^3; healthy fp16 runs settle at 2^10..2^17 from initial scales of
  2^16..2^32), and 2^-6 for fairseq, whose scaler starts at 2^7 and healthy runs go down to 1..4.
  Clears once the scale grows above that level. DeepSpeed's exit at its minimum scale
  (``Current loss scale already at minimum``) is a collapse whatever was seen before.
* ``jump``: one back-off larger than one ``decrease_factor`` (the value fell below
  ``from * decrease_factor / jump_tolerance``). The built-in managers never do this, so the scale
  was set by hand or the run restarted. Only transitions a producer prints per step are judged
  (DeepSpeed "Attempted loss scale: X, reducing to Y" / "from X to Y", and apex/fairseq/
  torch_npu "reducing to Y" compared with the previous value), because interval reports hide
  several halvings; ``jump_reports: true`` also judges consecutive interval reports. Clears at
  the next increase.

Warm-up (``decreases``, ``overflow_ratio``): the fast fall from the initial scale (2^32 TF/NPU and
Megatron, 2^24 MindSpore, 2^16 torch/DeepSpeed) is normal. It ends at the first observed increase
or once the training step reaches ``warmup_steps``; while no step number is known it lasts until
the first increase. Decreases are counted from scale values, never from overflow messages, so
DeepSpeed/Megatron hysteresis overflows (skipped, no back-off) never count as decreases.

``framework`` picks defaults for ``window``, ``decrease_factor`` and ``warmup_steps``; an explicit
value always wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

from pydantic import Field, model_validator

from ..model import GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, OVERFLOW, Sample
from ..series.state import SeriesState
from . import loss_scale_bulk
from .base import Clear, Detector, Hit, Params, PerSeries, step_of

# framework -> defaults; the comments name the initial scale, back-off rule and minimum of each
PRESETS: dict[str, dict[str, Any]] = {
    "generic": {"window": 2000, "decrease_factor": 0.5, "warmup_steps": 200},     # floor: from the producer
    "tf_npu": {"window": 1000, "decrease_factor": 0.5, "warmup_steps": 200,       # init 2^32, 2 bad steps/decrease,
               "floor": 1.0},                                                     # clamps at 1
    "mindspore": {"window": 2000, "decrease_factor": 0.5, "warmup_steps": 200,    # init 2^24, every overflow halves,
                  "floor": 1.0},                                                  # clamps at 1
    "torch": {"window": 2000, "decrease_factor": 0.5, "warmup_steps": 200,        # GradScaler init 2^16, no clamp:
              "floor": 1.0},                                                      # 1 is already abnormal
    "deepspeed": {"window": 1000, "decrease_factor": 0.5, "warmup_steps": 200,    # init 2^16, hysteresis 2,
                  "floor": 1.0},                                                  # min_loss_scale 1
    "megatron": {"window": 1000, "decrease_factor": 0.5, "warmup_steps": 200,     # init 2^32, hysteresis 2,
                 "floor": 1.0},                                                   # --min-loss-scale 1
    "fairseq": {"window": 2000, "decrease_factor": 0.5, "warmup_steps": 200,      # init 2^7; window 2^14/(world
                "floor": 1e-4},                                                   # x update_freq); stops at 1e-4
}

Framework = Literal["generic", "tf_npu", "mindspore", "torch", "deepspeed", "megatron", "fairseq"]

# ``floor: auto`` by producer (a parser name); anything else uses DEFAULT_FLOOR
PRODUCER_FLOORS: dict[str, float] = {"fairseq": 1e-4}
DEFAULT_FLOOR = 1.0


# ``collapse_below: auto`` by framework or producer; anything else uses DEFAULT_COLLAPSE
COLLAPSE_LEVELS: dict[str, float] = {"fairseq": 2.0 ** -6}
DEFAULT_COLLAPSE = 8.0


class LossScaleParams(Params):
    condition: Literal["floor", "decreases", "overflow_ratio", "jump", "collapse"] = "floor"
    collapse_below: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    min_backoffs: int = Field(3, ge=1)
    floor: Annotated[float, Field(ge=0)] | Literal["auto"] = "auto"
    framework: Framework = "generic"
    window: int = Field(2000, ge=1)                 # steps
    decrease_factor: float = Field(0.5, gt=0, lt=1)
    warmup_steps: int = Field(200, ge=0)
    min_decreases: int = Field(3, ge=1)
    max_overflow_ratio: float = Field(0.05, ge=0, lt=1)
    min_steps: int = Field(100, ge=1)
    jump_tolerance: float = Field(1.25, ge=1)
    jump_reports: bool = False

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fw = data.get("framework", "generic")
            preset = PRESETS.get(fw) if isinstance(fw, str) else None
            if preset:
                data = {**preset, **data}
        return data


@dataclass(slots=True)  # no __dict__: one per followed series
class _Track:
    last: float | None = None
    warm: bool = True
    decreases: list = field(default_factory=list)  # (step | None, implied back-offs)
    overflows: list = field(default_factory=list)  # (step, skipped steps)
    skipped: float = 0.0                              # sum over ``overflows``
    span_start: int | None = None
    judged_step: int | None = None  # overflow_ratio: the step last judged
    active: bool = False
    announced: float | None = None  # floor the producer announced ("Minimum loss scale reached (X)")
    announcing: bool = False        # the next scale value is that announced minimum
    floor: float | None = None      # floor: the floor in force at the last value, and its source
    floor_source: str = ""
    backoffs: int = 0               # collapse: back-offs in a row since the scale last grew
    run_from: float | None = None   # collapse: the scale that run of back-offs started from


_PROGRESS = frozenset({LOSS, GRAD_NORM, LEARNING_RATE, LOSS_SCALE})


class LossScaleDetector(Detector[LossScaleParams]):
    kind = "loss_scale"
    params_model = LossScaleParams
    metrics = frozenset({LOSS_SCALE, OVERFLOW}) | _PROGRESS
    stateful = True

    def __init__(self, params: LossScaleParams) -> None:
        super().__init__(params)
        self._tracks: PerSeries[_Track] = PerSeries(_Track)

    def wanted_metrics(self) -> frozenset[str]:
        if self.params.condition == "overflow_ratio":
            return frozenset({OVERFLOW}) | _PROGRESS - {GRAD_NORM}  # a grad norm never comes alone
        if self.params.condition in ("floor", "collapse"):
            # OVERFLOW: fairseq's minimum reached / an overflow at the floor; DeepSpeed's exit there
            return frozenset({LOSS_SCALE, OVERFLOW})
        return frozenset({LOSS_SCALE})

    def observe(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        return self.observer()(sample, series)

    def observer(self) -> Callable[[Sample, SeriesState], Hit | Clear | None]:
        """The condition's own method, without ``observe``'s dispatch (unless ``observe`` was
        replaced: then that is what is asked)."""
        if type(self).observe is not _OBSERVE:
            return self.observe
        return {"floor": self._floor, "overflow_ratio": self._overflow_ratio,
                "collapse": self._collapse}.get(self.params.condition, self._trajectory)

    def once_per_record(self, metric: str) -> bool:
        # overflow_ratio judges a step once: the record's other values (its step, or the series'
        # last step for them all) find it judged; an overflow event is always counted
        return self.params.condition == "overflow_ratio" and metric != OVERFLOW

    plan, absorb = loss_scale_bulk.plan, loss_scale_bulk.absorb  # catching up on a backlog

    # -- floor -----------------------------------------------------------------------------------
    def _floor(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        if sample.metric != LOSS_SCALE:
            if sample.attr("variant") == "min_scale":
                self._tracks.get(sample.labels).announcing = True
                return None
            t = self._tracks.peek(sample.labels)
            if series.scale_last is None or t is None or t.active or t.floor is None:
                return None
            if series.scale_last <= t.floor and judged_at_floor(series):  # an overflow at the floor
                t.active = True
                return self._floor_hit(sample, series, series.scale_last, t.floor, t.floor_source)
            return None
        floor, source = self.floor_for(sample)
        t = self._tracks.get(sample.labels)
        if self.params.floor == "auto":
            if t.announcing:
                t.announcing, t.announced = False, sample.value
            if t.announced is not None and t.announced > floor:
                floor, source = t.announced, "announced by the producer"
        t.floor, t.floor_source = floor, source
        if sample.value <= floor and judged_at_floor(series):
            t.active = True
            return self._floor_hit(sample, series, sample.value, floor, source)
        return self._deactivate(t, sample)

    @staticmethod
    def _floor_hit(sample: Sample, series: SeriesState, value: float, floor: float, source: str) -> Hit:
        return Hit(sample.labels, f"loss scale {value:g} at or below floor {floor:g}",
                   value, step_of(sample, series),
                   sample.source, {"loss_scale": value, "floor": floor, "floor_source": source,
                                   "decreases": series.scale_decreases, "overflow_steps": series.overflow_steps,
                                   "precision": series.precision or "unknown",
                                   "first": series.scale_first, "min": series.scale_min})

    def floor_for(self, sample: Sample) -> tuple[float, str]:
        """The floor in force for ``sample`` and where it came from (rule, framework, producer)."""
        floor = self.params.floor
        if floor != "auto":
            return float(floor), "rule" if self.params.framework == "generic" else self.params.framework
        producer = getattr(sample, "producer", "") or ""
        if producer in PRODUCER_FLOORS:
            return PRODUCER_FLOORS[producer], producer
        return DEFAULT_FLOOR, "default"

    # -- collapse --------------------------------------------------------------------------------
    def collapse_level(self, sample: Sample) -> float:
        level = self.params.collapse_below
        if level != "auto":
            return float(level)
        fw = self.params.framework
        key = fw if fw != "generic" else (getattr(sample, "producer", "") or "")
        return COLLAPSE_LEVELS.get(key, DEFAULT_COLLAPSE)

    def _collapse(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        if sample.metric != LOSS_SCALE:
            return self._exit_at_minimum(sample, series)
        value = sample.value
        if not math.isfinite(value):
            return None
        t = self._tracks.get(sample.labels)
        frm = sample.attr("frm") if sample.attrs else None
        prev = t.last
        if frm is not None and prev is not None and frm > prev:
            t.backoffs, t.run_from = 0, frm  # grew silently between two messages
        before = frm if frm is not None else prev
        t.last = value
        if before is not None and value > before:
            t.backoffs, t.run_from = 0, value
        elif before is not None and value < before:
            if t.backoffs == 0:
                t.run_from = before
            t.backoffs += self._backoffs(before, value)
        elif before is None and sample.attr("decrease"):
            t.backoffs, t.run_from = 1, None  # "reducing loss scale to X", the first value seen
        level = self.collapse_level(sample)
        if value > level:
            if t.active:
                t.active = False
                return Clear(sample.labels)
            return None
        if t.backoffs < self.params.min_backoffs:
            return None
        t.active = True
        since = f"from {t.run_from:g} " if t.run_from is not None else ""
        return Hit(sample.labels,
                   f"loss scale collapsed {since}to {value:g} in {t.backoffs} back-offs without growth "
                   f"(collapse level {level:g})", value, step_of(sample, series), sample.source,
                   {"loss_scale": value, "backoffs": t.backoffs, "from": t.run_from, "collapse_below": level,
                    "overflow_steps": series.overflow_steps, "first": series.scale_first, "min": series.scale_min})

    def _exit_at_minimum(self, sample: Sample, series: SeriesState) -> Hit | None:
        """DeepSpeed's exit at its minimum scale (``min_scale_exit``, parsers/deepspeed.py): the
        scaler overflowed there and ended the run; a collapse, back-offs seen or not."""
        if sample.attr("variant") != "min_scale_exit":
            return None
        t = self._tracks.get(sample.labels)
        t.active, known = True, series.scale_last is not None
        value = series.scale_last if known else 1.0
        return Hit(sample.labels, "loss scale at its minimum and still overflowing: the trainer ended the run",
                   value, step_of(sample, series), sample.source,
                   {"loss_scale": value, "backoffs": t.backoffs, "from": t.run_from or series.scale_first,
                    "loss_scale_source": "last printed" if known else "not printed: DeepSpeed's default minimum",
                    "overflow_steps": series.overflow_steps, "first": series.scale_first, "min": series.scale_min})

    # -- warm-up ---------------------------------------------------------------------------------
    def _warm(self, t: _Track, step: int | None, series: SeriesState) -> bool:
        if t.warm and ((step is not None and step >= self.params.warmup_steps) or series.scale_increases > 0):
            t.warm = False
        return t.warm

    def _backoffs(self, frm: float, to: float) -> int:
        if to <= 0 or frm <= 0:
            return 1
        ratio = frm / to
        # a ratio past the float range (a scale from ~1e308 down to a denormal): the logs' difference
        span = math.log(ratio) if math.isfinite(ratio) else math.log(frm) - math.log(to)
        return max(1, round(span / math.log(1 / self.params.decrease_factor)))

    # -- decreases / jump ------------------------------------------------------------------------
    def _trajectory(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        p = self.params
        t = self._tracks.get(sample.labels)
        value = sample.value
        if value == t.last and not sample.attrs and not t.decreases and not t.active:
            return None  # the same value again (an interval report), nothing held: nothing changes
        step = step_of(sample, series)
        if not math.isfinite(value):
            return None
        frm = sample.attr("frm")
        prev = t.last
        increased = False
        if frm is not None:
            if prev is not None and frm > prev:
                increased = True  # the scale grew between two messages without a message of its own
            before = frm
            per_step = True
        else:
            before = prev
            per_step = bool(sample.attr("decrease")) or p.jump_reports
        t.last = value
        if before is not None and value > before:
            increased = True
        decreased = (before is not None and value < before) or (before is None and bool(sample.attr("decrease")))
        if increased:
            t.warm = False
            t.decreases.clear()
        if p.condition == "jump":
            return self._jump(sample, series, t, before, value, per_step, increased, step)
        if increased and not decreased:
            return self._deactivate(t, sample)
        if step is not None:
            while t.decreases and t.decreases[0][0] is not None and t.decreases[0][0] <= step - p.window:
                del t.decreases[0]
        if decreased and not self._warm(t, step, series):
            n = self._backoffs(before, value) if before is not None else 1
            t.decreases.append((step, n))
        total = sum(n for _, n in t.decreases)
        if total < p.min_decreases:
            return self._deactivate(t, sample)
        if not decreased:
            return None  # still holding; nothing new
        t.active = True
        first = t.decreases[0][0]
        return Hit(sample.labels,
                   f"loss scale decreased {total} times within {p.window} steps with no increase "
                   f"(now {value:g})", value, step, sample.source,
                   {"loss_scale": value, "decreases": total, "window": p.window, "since_step": first,
                    "min_decreases": p.min_decreases, "first": series.scale_first, "min": series.scale_min})

    def _jump(self, sample: Sample, series: SeriesState, t: _Track, before: float | None, value: float,
              per_step: bool, increased: bool, step: int | None) -> Hit | Clear | None:
        p = self.params
        if increased:
            return self._deactivate(t, sample)
        if before is None or not per_step or before <= 0:
            return None
        limit = before * p.decrease_factor / p.jump_tolerance
        if value >= limit:
            return None
        t.active = True
        return Hit(sample.labels, f"loss scale jumped from {before:g} to {value:g} in one back-off "
                                  f"(one back-off is x{p.decrease_factor:g})",
                   value, step, sample.source,
                   {"loss_scale": value, "from": before, "factor": value / before,
                    "decrease_factor": p.decrease_factor})

    def _deactivate(self, t: _Track, sample: Sample) -> Clear | None:
        if t.active:
            t.active = False
            return Clear(sample.labels)
        return None

    # -- overflow ratio --------------------------------------------------------------------------
    def _overflow_ratio(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        step = sample.step  # step_of, inline: asked for every value of every record
        if step is None:
            step = series.last_step
            if step is None:
                return None  # a ratio over steps needs step numbers
        t = self._tracks.get(sample.labels)
        if step == t.judged_step and sample.metric != OVERFLOW:
            return None  # another value of a step already judged: the ratio is the same
        p = self.params
        t.judged_step = step
        if self._warm(t, step, series):
            return None
        if t.span_start is None or step < t.span_start:  # first step after warm-up, or a restart
            t.span_start = step
            t.overflows.clear()
            t.skipped = 0.0
        if sample.metric == OVERFLOW:
            n = max(sample.value, 0.0)
            t.overflows.append((step, n))
            t.skipped += n
        while t.overflows and t.overflows[0][0] <= step - p.window:
            t.skipped -= t.overflows[0][1]
            del t.overflows[0]
        span = min(p.window, step - t.span_start + 1)
        if span < p.min_steps:
            return None
        skipped = t.skipped
        ratio = skipped / span
        if ratio <= p.max_overflow_ratio:
            return self._deactivate(t, sample)
        if t.active:
            return None
        t.active = True
        return Hit(sample.labels, f"{skipped:g} of the last {span} steps overflowed ({ratio:.1%} > "
                                  f"{p.max_overflow_ratio:.1%})",
                   ratio, step, sample.source,
                   {"ratio": round(ratio, 6), "overflow_steps": skipped, "steps": span,
                    "max_overflow_ratio": p.max_overflow_ratio, "loss_scale": series.scale_last})


_OBSERVE = LossScaleDetector.observe  # as defined here (a subclass or a test may replace it)


def judged_at_floor(series: SeriesState) -> bool:
    """Whether a scale at the floor is a dynamic scaler that came down there (or a known fp16 run
    sitting there), rather than a value that is no dynamic loss scale (docs/rules.md)."""
    if series.dynamic_evidence:
        return True
    return series.precision == "fp16" and series.scaler != "static"
