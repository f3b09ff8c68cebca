"""The one small interface every rule kind implements.

A detector sees the (deduplicated) samples of the metrics it cares about, together with the
state of their series, and answers: the condition holds now (``Hit``), it stopped holding
(``Clear``), or nothing changed (``None``). Everything else (for:, labels, templating, the
alert lifecycle, persistence) is the same for every kind and lives outside detectors.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from collections import OrderedDict
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from ..model import Labels, Sample, SourcePos
from ..series import SeriesState


class Params(BaseModel):
    """Base for a kind's parameters: unknown keys are errors, so typos do not pass silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


P = TypeVar("P", bound=Params)


@dataclass(frozen=True, slots=True)
class Hit:
    labels: Labels
    message: str
    value: float | None = None
    step: int | None = None
    source: SourcePos | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Clear:
    labels: Labels


class Detector(abc.ABC, Generic[P]):
    kind: ClassVar[str]
    params_model: ClassVar[type[Params]]
    metrics: ClassVar[frozenset[str]]
    # True: the condition is a state (e.g. "scale at the floor") that clears itself when the
    # data says so. False: the condition is an event (e.g. "a NaN appeared") whose alert
    # resolves once ``resolve_after`` passes without another hit.
    stateful: ClassVar[bool] = False
    default_resolve_after: ClassVar[float] = 600.0

    def __init__(self, params: P) -> None:
        self.params = params

    def wanted_metrics(self) -> frozenset[str]:
        """Metrics this instance needs; a kind may narrow it from its parameters."""
        return self.metrics

    @abc.abstractmethod
    def observe(self, sample: Sample, series: SeriesState) -> Hit | Clear | None:
        """Judge one accepted sample of ``series``."""

    def tick(self, now: float, series: SeriesState) -> Hit | Clear | None:
        """Judge ``series`` when no sample arrived (e.g. "no new step for 10 minutes").
        Called every evaluation interval for each series the rule matches; most kinds need
        nothing here."""
        return None


V = TypeVar("V")


class PerSeries(Generic[V]):
    """Per-series detector memory, bounded: the least recently seen series is dropped first.

    A detector instance belongs to one rule and sees every series that rule matches; keeping
    its memory here stops a long-lived daemon from growing without bound."""

    def __init__(self, factory: type[V] | Any, cap: int = 1000) -> None:
        self._factory = factory
        self._cap = cap
        self._d: OrderedDict[Labels, V] = OrderedDict()

    def get(self, labels: Labels) -> V:
        v = self._d.get(labels)
        if v is None:
            if len(self._d) >= self._cap:
                self._d.popitem(last=False)
            v = self._d[labels] = self._factory()
        else:
            self._d.move_to_end(labels)
        return v

    def peek(self, labels: Labels) -> V | None:
        return self._d.get(labels)

    def drop(self, labels: Labels) -> None:
        self._d.pop(labels, None)

    def __len__(self) -> int:
        return len(self._d)


def step_of(sample: Sample, series: SeriesState) -> int | None:
    return sample.step if sample.step is not None else series.last_step
