"""``stalled``: a series that had been reporting training steps went quiet.

Judged on every evaluation tick, from the wall-clock time the agent read the series' last record
(``progress: record``, the default: any parsed line counts as life) or the last record that
advanced the step (``progress: step``: overflow messages and other step-less chatter do not
count). A series that never printed a step number is never judged, so a log that only carries
messages cannot page anyone.

A state kind: hits once when the series has been quiet for ``after``; clears when a new record
(or step) arrives. A finished run also goes quiet: after ``expire_after`` of silence the
condition is cleared and the series is no longer judged until it reports again (``0``: never
expire). A series whose trainer announced the normal end of training (``[after training is
done]``, ``Training completed``, ...: agent/readers/parsers/hints.py) is not judged either.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..config import Duration
from ..model import NONFINITE_MESSAGE, OVERFLOW, TRAINING_METRICS, Labels, Sample
from ..series.state import SeriesState
from .base import Clear, Detector, Hit, Params
from .base import PerSeries
from .batch import RunView


class StalledParams(Params):
    after: Duration = Field(600.0, gt=0)
    progress: Literal["record", "step"] = "record"
    expire_after: Duration = Field(6 * 3600.0, ge=0)


class _Track:
    __slots__ = ("step", "since", "active", "expired")

    def __init__(self) -> None:
        self.step: int | None = None
        self.since: float | None = None   # progress: step - when the step last advanced
        self.active = False
        self.expired = False


class StalledDetector(Detector[StalledParams]):
    kind = "stalled"
    params_model = StalledParams
    metrics = frozenset(TRAINING_METRICS) | {OVERFLOW, NONFINITE_MESSAGE}
    stateful = True

    def __init__(self, params: StalledParams) -> None:
        super().__init__(params)
        self._tracks: PerSeries[_Track] = PerSeries(_Track)

    def observe(self, sample: Sample, series: SeriesState) -> Clear | None:
        t = self._tracks.peek(sample.labels)
        if self.params.progress == "step":
            if t is None:
                t = self._tracks.get(sample.labels)
            step = sample.step
            if step is None or (t.step is not None and step <= t.step):
                return None  # no progress
            t.step, t.since = step, sample.time
        elif t is None:
            return None
        t.expired = False
        if t.active:
            t.active = False
            return Clear(sample.labels)
        return None

    def plan(self, labels: Labels, run: RunView, metrics: frozenset[str]) -> int:
        # progress: record: a series not stalled (or not yet judged) only notes it is alive
        t = self._tracks.value(labels)
        if self.params.progress == "step" or (t is not None and t.active):
            return run.first(metrics)
        return run.n

    def absorb(self, labels: Labels, run: RunView, metrics: frozenset[str], upto: int) -> None:
        if run.first(metrics) < upto:
            t = self._tracks.peek(labels)
            if t is not None:
                t.expired = False

    def once_per_record(self, metric: str) -> bool:
        # the first value of a record clears (record: any; step: one that advanced the step) and
        # leaves the track neither active nor expired; only tick() changes that again
        return True

    def tick(self, now: float, series: SeriesState) -> Hit | Clear | None:
        p = self.params
        if series.last_step is None or not (self.metrics & series.last.keys()
                                            or series.nonfinite.get(NONFINITE_MESSAGE)):
            return None  # no steps, or a dump series (scans, comparisons): not a training stream
        # read without noting a change: every series is ticked every evaluation, and a track
        # noted as changed is re-encoded and hashed at the next commit (store/book.py); ``get``
        # (which notes it) only where the track changes
        t = self._tracks.value(series.labels)
        if t is None:
            t = self._tracks.get(series.labels)
        if series.finished:  # the trainer announced the end of training: quiet is expected
            if t.active:
                self._tracks.get(series.labels).active = False
                return Clear(series.labels)
            return None
        if p.progress == "step":
            if t.step is None or (series.last_step is not None and series.last_step > t.step):
                t = self._tracks.get(series.labels)
                t.step, t.since = series.last_step, series.last_update  # e.g. after a restart
            since = t.since if t.since is not None else series.last_update
        else:
            since = series.last_update
        idle = now - since
        if p.expire_after and idle >= p.expire_after:
            if not t.expired or t.active:
                t = self._tracks.get(series.labels)
                t.expired = True
            if t.active:
                t.active = False
                return Clear(series.labels)
            return None
        if idle < p.after or t.active or t.expired:
            return None
        t = self._tracks.get(series.labels)
        t.active = True
        what = "step" if p.progress == "step" else "record"
        return Hit(series.labels, f"no new {what} for {idle:.0f}s"
                   + (f" (last step {series.last_step})" if series.last_step is not None else ""),
                   idle, series.last_step, None,
                   {"idle_s": round(idle, 3), "after_s": p.after, "last_step": series.last_step,
                    "last_update": since, "progress": p.progress})
