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
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from ..config.base import Strict
from ..model import Labels, Sample, SourcePos
from ..series.state import SeriesState

if TYPE_CHECKING:
    from .batch import RunView


class Params(Strict):
    """Base for a kind's parameters (the configuration's strict base: unknown keys are errors,
    so typos do not pass silently). Each kind's model lives beside its detector, like a plug-in."""


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
    def observe(self, sample: Sample, series: SeriesState) -> Hit | Clear | list[Hit | Clear] | None:
        """Judge one accepted sample of ``series``."""

    def observer(self) -> Callable[[Sample, SeriesState], Hit | Clear | list[Hit | Clear] | None]:
        """The callable the pipeline calls for each sample (once looked up per series and metric):
        ``observe`` itself, or the part of it this instance's parameters always take."""
        return self.observe

    def once_per_record(self, metric: str) -> bool:
        """Whether, once this rule observed a sample of a record (one line's values: the same
        source and step, in one ``Pipeline.process`` call, no restart in between), another
        sample of ``metric`` of that record would change nothing and answer None: the pipeline
        then skips it. False (every sample observed) unless a kind proves otherwise."""
        return False

    def plan(self, labels: Labels, run: "RunView", metrics: frozenset[str]) -> int:
        """Catching up (agent/engine/catchup.py): the position in ``run`` (samples of the series
        ``labels``, in order; ``metrics``: those of them this rule judges) of the first sample
        this rule must observe; before it, each sample it would be given would answer None and
        change its memory only as ``absorb`` does for them all at once. Decided on the samples
        and this rule's memory alone (the series state moves as they are read); the pipeline
        may end the bulk earlier, never later. 0 (observe every sample) unless a kind proves more."""
        return 0

    def absorb(self, labels: Labels, run: "RunView", metrics: frozenset[str], upto: int) -> None:
        """Take in the samples of ``metrics`` before position ``upto`` of ``run`` as observing
        them one by one would have (``plan`` said they answer None), memory marks included."""
        raise NotImplementedError(f"{type(self).__name__} plans no bulk")

    def tick(self, now: float, series: SeriesState) -> Hit | Clear | None:
        """Judge ``series`` when no sample arrived (e.g. "no new step for 10 minutes").
        Called every evaluation interval for each series the rule matches; most kinds need
        nothing here."""
        return None

    # -- memory that survives a restart (agent/store/memory.py) ----------------------------------------
    # Most kinds keep their memory in PerSeries attributes, which are persisted generically. A
    # kind whose memory lives elsewhere overrides state()/restore() and sets ``memory_dirty``
    # whenever that memory may have changed.
    memory_dirty: bool = False

    def state(self) -> Any:
        """Memory outside PerSeries as plain data (see agent/store/memory.py's codec); None: none."""
        return None

    def restore(self, data: Any) -> None:
        """Take back what ``state()`` returned before a restart."""


V = TypeVar("V")


class PerSeries(Generic[V]):
    """Per-series detector memory, bounded: the least recently seen series is dropped first.

    A detector instance belongs to one rule and sees every series that rule matches; keeping
    its memory here stops a long-lived daemon from growing without bound. It also notes which
    series' memory may have changed (``get``/``peek`` hand out a mutable value) and which were
    dropped, so the state store rewrites only those rows (agent/store/memory.py); the notes are
    bounded by the cap too: past it, ``reset`` asks for one full rewrite instead."""

    def __init__(self, factory: type[V] | Any, cap: int = 1000) -> None:
        self._factory = factory
        self._cap = cap
        self._d: OrderedDict[Labels, V] = OrderedDict()
        self.changed: set[Labels] = set()   # handed out since the last persist
        self.removed: set[Labels] = set()   # dropped since the last persist
        self.reset = False                  # too many drops to list: persist everything
        # the entry ``get`` handed out last: most recently seen and noted as changed already, so
        # the next ``get`` of the same series (the common case: several values of one record, one
        # series per run) returns it at once; forgotten when the notes or the entries change
        self._hot: Labels | None = None
        self._hot_v: V | None = None

    @property
    def factory(self) -> type[V] | Any:
        return self._factory

    def get(self, labels: Labels) -> V:
        if labels is self._hot:
            return self._hot_v  # type: ignore[return-value]
        v = self._d.get(labels)
        if v is None:
            if len(self._d) >= self._cap:
                self._forget(self._d.popitem(last=False)[0])
            v = self._d[labels] = self._factory()
        else:
            self._d.move_to_end(labels)
        self.changed.add(labels)
        self._hot, self._hot_v = labels, v
        return v

    def peek(self, labels: Labels) -> V | None:
        v = self._d.get(labels)
        if v is not None:
            self.changed.add(labels)  # the caller may change it
        return v

    def drop(self, labels: Labels) -> None:
        self._hot = None
        if self._d.pop(labels, None) is not None:
            self._forget(labels)

    def items(self) -> list[tuple[Labels, V]]:
        """Every entry, least recently seen first (a copy: for persisting, not for judging)."""
        return list(self._d.items())

    def value(self, labels: Labels) -> V | None:
        """The entry without marking it changed or recently seen."""
        return self._d.get(labels)

    def restore(self, labels: Labels, value: V) -> None:
        """Put back a persisted entry (most recently seen last), within the cap."""
        self._hot = None
        self._d[labels] = value
        self._d.move_to_end(labels)
        while len(self._d) > self._cap:  # e.g. the cap was lowered: those rows go at the next commit
            self._forget(self._d.popitem(last=False)[0])

    def persisted(self) -> None:
        """Everything noted so far is in the store."""
        self._hot = None
        self.changed.clear()
        self.removed.clear()
        self.reset = False

    def _forget(self, labels: Labels) -> None:
        self._hot = None
        self.changed.discard(labels)
        if not self.reset:
            self.removed.add(labels)
            if len(self.removed) > self._cap:
                self.reset, self.removed = True, set()

    def __len__(self) -> int:
        return len(self._d)


def step_of(sample: Sample, series: SeriesState) -> int | None:
    return sample.step if sample.step is not None else series.last_step


def slots_of(det: Detector) -> dict[str, PerSeries]:
    """The detector's PerSeries, by attribute path (one level of helper objects, e.g. StepQuota)."""
    out: dict[str, PerSeries] = {}
    for name, v in vars(det).items():
        if isinstance(v, PerSeries):
            out[name] = v
        elif hasattr(v, "__dict__") and not isinstance(v, (BaseModel, type)):
            for sub, w in vars(v).items():
                if isinstance(w, PerSeries):
                    out[f"{name}.{sub}"] = w
    return out


def explicit(det: Detector) -> bool:
    return type(det).state is not Detector.state
