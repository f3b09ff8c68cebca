"""``overflow``: too many overflow (skipped) steps within a window of training steps.

Counts the logical overflow steps the series layer accepts (one per overflow message, plus the
skips a trainer's counter reports beyond its messages, e.g. Megatron's ``number of skipped
iterations``). An event: each overflow step while the count of the last ``window`` steps is above
``max_overflows`` is a hit; the alert resolves ``resolve_after`` after the last one.

Warm-up: overflow storms while the dynamic loss scale falls from its initial value are normal;
steps before ``warmup_steps`` are ignored unless the series already showed a scale increase.
Overflows without any known step number cannot be placed in a window and are not judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from ..model import OVERFLOW, Sample
from ..series.state import SeriesState
from .base import Detector, Hit, Params
from .base import PerSeries, step_of


class OverflowParams(Params):
    window: int = Field(1000, ge=1)          # steps
    max_overflows: int = Field(20, ge=0)     # more than this many overflow steps in the window
    warmup_steps: int = Field(200, ge=0)


@dataclass(slots=True)  # no __dict__: one per followed series
class _Track:
    events: list = field(default_factory=list)  # (step, skipped steps)
    count: float = 0.0                             # sum over ``events``
    last_step: int | None = None


class OverflowDetector(Detector[OverflowParams]):
    kind = "overflow"
    params_model = OverflowParams
    metrics = frozenset({OVERFLOW})
    stateful = False
    default_resolve_after = 600.0

    def __init__(self, params: OverflowParams) -> None:
        super().__init__(params)
        self._tracks: PerSeries[_Track] = PerSeries(_Track)

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        p = self.params
        step = step_of(sample, series)
        if step is None:
            return None
        if step < p.warmup_steps and series.scale_increases == 0:
            return None
        t = self._tracks.get(sample.labels)
        if t.last_step is not None and step < t.last_step:  # the run restarted from a checkpoint
            t.events.clear()
            t.count = 0.0
        t.last_step = step
        n = max(sample.value, 0.0)
        t.events.append((step, n))
        t.count += n
        while t.events and t.events[0][0] <= step - p.window:
            t.count -= t.events[0][1]
            del t.events[0]
        count = t.count
        if count <= p.max_overflows:
            return None
        return Hit(sample.labels, f"{count:g} overflow (skipped) steps within {p.window} steps "
                                  f"(more than {p.max_overflows})",
                   count, step, sample.source,
                   {"overflow_steps": count, "window": p.window, "max_overflows": p.max_overflows,
                    "since_step": t.events[0][0], "loss_scale": series.scale_last})
