"""Dump incidents: one alert per incident of a run, not one per step or op (issue 20).

A run's dumps go bad at some step (a NaN, an Opdebug overflow, a divergence from the benchmark)
and, as a NaN spreads into the weights, usually stay bad: each later step has its own "first bad
op" (at step 4 the NaN weights make ``mse_loss.backward`` the first op with finite inputs and a
non-finite output). Those steps are the same incident. The incident kinds (``dump_nonfinite``,
``dump_overflow``, ``dump_divergence``) keep, per run (the series' labels less ``rank``):

- the **origin**: the lowest bad step seen in this attempt, its rank and op. Ranks that tie on the
  step are ordered by the op's position in execution order (``order``: the same program runs the
  same ops in the same order on every rank); the earliest wins, a tie names every tied rank;
- the **affected steps** (the first ``MAX_STEPS`` listed, all counted) and the first ops of the
  later steps (``MAX_OPS`` distinct ones listed, with their step and rank).

The alert's labels are the run's labels plus ``incident`` (1, 2, ... per run): a later bad step,
another rank or another op never changes them, so it counts into the open alert (no new page)
and refreshes its evidence. A **new incident** (a new alert, a new page) starts when

- the run starts over: a rank's dump at a step it has already passed (or the same step in another
  directory), written after the one seen (a dump without a write time is never a restart): a restart from a checkpoint into the same dump root (a
  new dump root is another ``run`` anyway); the open incident then resolves;
- or the run had been clean for ``clean_steps`` dumped steps after its last bad one (the
  ``dump_step`` markers of agent/dumps/samples.py say which steps were clean): the incident
  resolves then, and the next bad step opens the next one.

Otherwise it resolves as any event alert: ``resolve_after`` without a bad step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pydantic import Field

from ..model import DUMP_STEP, Labels, Sample, SourcePos
from ..series.state import SeriesState
from .base import Clear, Detector, Hit, Params, PerSeries

MAX_STEPS = 64      # affected steps listed in the evidence (all are counted)
MAX_OPS = 16        # later steps' first ops listed
MAX_RANKS = 64      # tied origin ranks named, and ranks whose progress is followed per run
_KEY = "__incident__"


def _scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None)))


class IncidentParams(Params):
    clean_steps: int = Field(3, ge=1)   # clean dumped steps after the last bad one that end an incident


@dataclass(slots=True)
class Incident:
    """One run's incident state (one persisted row per run and rule)."""

    number: int = 0                     # incidents of this run so far: the open one's ``incident`` label
    open: bool = False
    origin_step: int | None = None
    origin_ranks: list = field(default_factory=list)   # tied ranks (str), first is the first seen
    origin_op: str = ""
    origin_order: int | None = None
    origin: dict = field(default_factory=dict)   # the origin sample's attrs (tensor, nonfinite, dtype ...)
    steps: list = field(default_factory=list)    # affected steps, ascending, at most MAX_STEPS
    affected: int = 0                            # affected steps, all counted
    ops: list = field(default_factory=list)      # [op, step, rank] of later steps' first ops
    last_bad: int | None = None
    clean: list = field(default_factory=list)    # clean steps after last_bad
    tops: dict = field(default_factory=dict)     # rank -> [highest step, its directory, when written]
    message: str = ""


def _rank(s: Sample) -> str:
    """The sample's rank: its ``rank`` attr, else its ``rank`` label (a comparison's sample)."""
    r = s.attr("rank")
    if r is None:
        r = dict(s.labels).get("rank")
    return "" if r is None else str(r)


def _int(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


class Incidents:
    """The incident book of one rule (a detector's helper: its PerSeries is persisted)."""

    def __init__(self, params: IncidentParams, cap: int = 1000) -> None:
        self.params = params
        self.runs: PerSeries[Incident] = PerSeries(Incident, cap)

    @staticmethod
    def run_key(labels: Labels) -> Labels:
        return tuple(kv for kv in labels if kv[0] != "rank") + ((_KEY, ""),)

    @staticmethod
    def alert_labels(key: Labels, inc: Incident) -> Labels:
        return tuple(kv for kv in key if kv[0] != _KEY) + (("incident", str(inc.number)),)

    # -- progress ------------------------------------------------------------------------------
    def _restarted(self, inc: Incident, rank: str, step: int | None, s: Sample) -> bool:
        """This dump belongs to a new attempt of the run (see the module doc); notes its progress."""
        if step is None:
            return False
        unit, written = s.source.path if s.source else "", s.attr("written")
        top = inc.tops.get(rank)
        if top:
            # written later than the rank's furthest dump; without write times (``scan`` of one
            # tree, a sample whose rank is unknown) nothing tells a restart from another rank's or
            # a late directory: never a restart
            restart = ((step < top[0] or (step == top[0] and unit != top[1]))
                       and written is not None and top[2] is not None and written > top[2])
        else:   # a rank not seen before (a single process's proc<PID> after a restart) behind the others
            hi = max(inc.tops.values(), key=lambda t: t[0], default=None)
            restart = (hi is not None and step < hi[0] and written is not None and hi[2] is not None
                       and written > hi[2])
        if restart:
            inc.tops = {}
        if not top or restart or step > top[0]:
            if rank in inc.tops or len(inc.tops) < MAX_RANKS:
                inc.tops[rank] = [step, unit, written]
        return restart

    def _close(self, key: Labels, inc: Incident) -> list[Hit | Clear]:
        if not inc.open:
            return []
        inc.open = False
        return [Clear(self.alert_labels(key, inc))]

    def _affected(self, inc: Incident, step: int | None) -> None:
        if step is None or step in inc.steps:
            return
        if len(inc.steps) < MAX_STEPS or step < inc.steps[-1]:
            inc.steps.append(step)
            inc.steps.sort()
            if len(inc.steps) > MAX_STEPS:
                inc.steps.pop()
        inc.affected += 1
        if inc.last_bad is None or step > inc.last_bad:
            inc.last_bad = step
        inc.clean = [c for c in inc.clean if c > inc.last_bad]

    # -- inputs --------------------------------------------------------------------------------
    def marker(self, s: Sample, step: int | None, bad: bool) -> list[Hit | Clear]:
        """A (step, rank) of a dump that was scanned: bad or clean for this kind."""
        key = self.run_key(s.labels)
        inc = self.runs.get(key)
        rank = _rank(s)
        out = self._close(key, inc) if self._restarted(inc, rank, step, s) else []
        if not inc.open or step is None:
            return out
        if bad:
            if step not in inc.steps and step != inc.last_bad:   # a bad step no op was named for
                self._affected(inc, step)
                out.append(self._hit(key, inc, s, inc.message))
            return out
        if (inc.last_bad is None or step > inc.last_bad) and step not in inc.clean:
            inc.clean.append(step)
            if len(inc.clean) >= self.params.clean_steps:
                out += self._close(key, inc)
        return out

    def bad(self, s: Sample, message: str, evidence: dict[str, Any]) -> list[Hit | Clear]:
        """A bad step's first op (``op``, ``order`` attrs of ``s``): opens or joins the run's incident."""
        key = self.run_key(s.labels)
        inc = self.runs.get(key)
        step, rank, op, order = _int(s.step), _rank(s), str(s.attr("op", "") or ""), _int(s.attr("order"))
        out = self._close(key, inc) if self._restarted(inc, rank, step, s) else []
        evidence = {**evidence, "dump": s.source.path if s.source else ""}
        if not inc.open:
            inc.number += 1
            inc.open = True
            inc.steps, inc.affected, inc.ops, inc.clean, inc.last_bad = [], 0, [], [], None
            inc.message = message
            self._origin(inc, step, rank, op, order, evidence)
        elif self._earlier(inc, step, order):
            self._later(inc, inc.origin_op, inc.origin_step, inc.origin_ranks[0] if inc.origin_ranks else "")
            self._origin(inc, step, rank, op, order, evidence)
        elif step == inc.origin_step and order == inc.origin_order and op == inc.origin_op:
            if rank not in inc.origin_ranks and len(inc.origin_ranks) < MAX_RANKS:
                inc.origin_ranks.append(rank)   # a tie: same step, same op at the same place
        elif not (step == inc.origin_step and rank in inc.origin_ranks):
            self._later(inc, op, step, rank)
        self._affected(inc, step)
        return out + [self._hit(key, inc, s, message)]

    # -- internals -----------------------------------------------------------------------------
    @staticmethod
    def _earlier(inc: Incident, step: int | None, order: int | None) -> bool:
        if step is None or inc.origin_step is None:
            return False
        if step != inc.origin_step:
            return step < inc.origin_step
        return order is not None and (inc.origin_order is None or order < inc.origin_order)

    @staticmethod
    def _origin(inc: Incident, step: int | None, rank: str, op: str, order: int | None,
                evidence: dict[str, Any]) -> None:
        inc.origin_step, inc.origin_ranks, inc.origin_op, inc.origin_order = step, [rank], op, order
        inc.origin = {k: v for k, v in evidence.items() if _scalar(v) or (
            isinstance(v, (list, tuple)) and len(v) <= 16 and all(map(_scalar, v)))}   # e.g. unreadable_before

    @staticmethod
    def _later(inc: Incident, op: str, step: int | None, rank: str) -> None:
        if op and len(inc.ops) < MAX_OPS and not any(o[0] == op for o in inc.ops):
            inc.ops.append([op, step, rank])

    def _hit(self, key: Labels, inc: Incident, s: Sample, message: str) -> Hit:
        ranks = ",".join(inc.origin_ranks)
        where = ", ".join(([f"step {inc.origin_step}"] if inc.origin_step is not None else [])
                          + ([f"rank {ranks}"] if ranks else [])) or "no step or rank number"
        evidence = {"where": where, **inc.origin, "incident": inc.number, "op": inc.origin_op, "origin_step": inc.origin_step,
                    "origin_rank": ranks, "origin_ranks": list(inc.origin_ranks),
                    "affected_steps": list(inc.steps), "affected_steps_total": inc.affected,
                    "last_bad_step": inc.last_bad,
                    "later_ops": [{"op": o, "step": st, "rank": r} for o, st, r in inc.ops],
                    "later_ops_text": ", ".join(f"{o} (step {st})" for o, st, _r in inc.ops) or "none",
                    "latest_step": _int(s.attr("step", s.step)), "latest_rank": _rank(s)}
        return Hit(self.alert_labels(key, inc), f"{message}: {inc.origin_op} ({where})", s.value,
                   inc.origin_step, SourcePos(str(inc.origin.get("dump") or ""), 0), evidence)


P = TypeVar("P", bound=IncidentParams)


class IncidentKind(Detector[P]):
    """Base of the incident kinds: ``dump_step`` markers (their ``flag`` attr says bad or clean)
    go to ``Incidents.marker``, the kind's own samples to ``bad`` (or, with ``zero_is_clean``, a
    sample of value 0 is a clean step: a comparison that matched)."""

    flag: ClassVar[str] = ""              # the dump_step marker's attr that says "bad"
    zero_is_clean: ClassVar[bool] = False   # the kind's own samples of value 0 are clean steps
    default_resolve_after: ClassVar[float] = 3600.0

    def __init__(self, params: P) -> None:
        super().__init__(params)
        self.incidents = Incidents(params)

    def bad(self, sample: Sample) -> list[Hit | Clear]:
        raise NotImplementedError

    def observe(self, sample: Sample, series: SeriesState) -> list[Hit | Clear] | None:
        if sample.metric == DUMP_STEP:
            out = self.incidents.marker(sample, _int(sample.attr("step")), bool(sample.attr(self.flag)))
        elif self.zero_is_clean and not sample.value:   # a comparison that matched
            out = self.incidents.marker(sample, _int(sample.step), False)
        else:
            out = self.bad(sample)
        return out or None
