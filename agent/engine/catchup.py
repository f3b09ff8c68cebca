"""Judging a run of one series' samples: the hot loop of ``Pipeline.process``.

A run is what ``process`` was handed of one series in a row (a backlog: thousands of records of
one file). Each sample goes through the series state and then to the rules of the series' table
(metric -> the rules that judge it) one at a time, in order; the samples that answer only
themselves, of metrics no rule observes one by one, go through the series state in one call
(``SeriesState.ingest_run``: ``ingest`` a sample after the other, a record's later values the
short way).

Where the run is long enough, each rule is first asked for its plan (``Detector.plan``, over a
``RunView`` of the run): the position of the first sample it may answer something for, or
change its memory otherwise than ``Detector.absorb`` reproduces in one call. Until there it is
left out of the per-sample loop; at that position (or earlier, when the series state makes
samples the plan could not see: an overflow event a scale value proves, a copy it drops, a
restart) the samples before are absorbed in one call and the rule observes the rest as usual.
Findings, alerts and detector memory are the same as with every sample observed
(tests/engine/test_pipeline_batches.py): a rule in bulk is one that would have said nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..detectors import Detector
from ..detectors.batch import RunView
from ..model import Finding, Labels, Sample, SourcePos
from ..series.state import SeriesState

if TYPE_CHECKING:
    from .pipeline import Entry, Pipeline

log = logging.getLogger(__name__)

PLAN_MIN = 48     # shorter runs (a live file's few new lines) are judged a sample at a time
RUN_MAX = 4096    # longer runs are cut: a rule that must observe from a sample on does so for the rest


def judge_run(pl: "Pipeline", labels: Labels, series: SeriesState, table: dict[str, "tuple[Entry, ...]"],
              run: list[Sample], out: list[Finding]) -> None:
    n = len(run)
    bulk: dict[int, list[Any]] = {}  # id(rule) -> [rule, its metrics in the run, where it is observed from]
    live = table                    # metric -> the entries observed sample by sample
    view: RunView | None = None
    if n >= PLAN_MIN:
        view = RunView(run)
        for m in view.metrics():
            for entry in table.get(m) or pl._add(labels, m):
                b = bulk.get(id(entry[0]))
                if b is None:
                    bulk[id(entry[0])] = [entry[0], {m}, 0]
                else:
                    b[1].add(m)
        for key, b in list(bulk.items()):
            b[1] = frozenset(b[1])
            try:
                det = b[0].detector
                b[2] = det.plan(labels, view, b[1]) if _plans_for_observe(det) else 0
            except Exception:  # a plan that fails only costs time: the rule observes every sample
                log.exception("rule %s: no plan for a run", b[0].name)
                b[2] = 0
            if b[2] <= 0:
                del bulk[key]
        if bulk:
            live = _live(table, bulk)
    unjudged = {m for m, entries in live.items() if not entries}  # metrics no rule observes one by one

    def release(keys: list[int], upto: int) -> None:
        """The rules ``keys`` absorb the run's samples before ``upto`` and observe from there."""
        nonlocal live, next_at, unjudged
        for k in keys:
            rule, metrics, _at = bulk.pop(k)
            if upto > 0:
                try:
                    rule.detector.absorb(labels, view, metrics, upto)
                except Exception as exc:
                    pl._detector_failed(rule, exc)
        live = _live(table, bulk) if bulk else table
        unjudged = {m for m, entries in live.items() if not entries}
        next_at = min((b[2] for b in bulk.values()), default=n)

    next_at = min((b[2] for b in bulk.values()), default=n)
    on_accepted = pl.on_accepted
    rec: tuple[SourcePos | None, int | None] = (None, None)  # the record in hand: line, step
    done = 0  # bits of the once-per-record rules that observed a sample of it
    ingest_run = series.ingest_run
    i = 0
    while i < n:
        if i >= next_at:
            release([k for k, b in bulk.items() if b[2] <= i], i)
        attempt = series.attempt
        # the samples that answer only themselves, of a metric no rule observes one by one, go
        # through the series state in one call (the common case of a backlog)
        i, accepted_samples = ingest_run(run, i, next_at if next_at < n else n,
                                         unjudged if on_accepted is None else _NONE)
        if accepted_samples is None:
            continue
        sample = run[i]
        if series.attempt != attempt:
            if bulk:
                release(list(bulk), i)
            pl._new_attempt(labels, sample.time)
            rec = (None, None)
        own = False  # the sample itself came out of the series state (a copy does not)
        for accepted in accepted_samples:
            if accepted is sample and not own:
                own = True
            elif bulk:  # a sample the plans did not see: every rule observes from here
                release(list(bulk), i + 1 if own else i)
            if on_accepted is not None:
                on_accepted(accepted, series)
            if accepted.labels is not labels:  # not the series' own labels: every rule, no table
                pl._judge(accepted, series, pl._rules(accepted.labels, accepted.metric), out)
                continue
            metric = accepted.metric
            rules = live.get(metric)
            if rules is None:
                rules = table.get(metric)
                if rules is None:
                    rules = pl._add(labels, metric)
            if not rules:
                continue
            src = accepted.source
            if src is not rec[0] or accepted.step != rec[1] or src is None:
                rec, done = (src, accepted.step), 0
            for rule, observe, bit in rules:  # Pipeline._judge, inline: once per value and rule
                if bit:
                    if done & bit:
                        continue  # it saw this record already: another value changes nothing
                    done |= bit
                try:
                    signal = observe(accepted, series)
                except Exception as exc:  # one broken rule must not stop the others
                    pl._detector_failed(rule, exc)
                    continue
                if signal is not None:  # most samples change nothing
                    pl._signals(rule, signal, accepted.time, out)
        if not own and bulk:  # dropped (a copy): the plans counted it
            release(list(bulk), i)
        i += 1
    if bulk:
        release(list(bulk), n)


def _plans_for_observe(det: Any) -> bool:
    """Whether the detector's plan speaks for what it observes: not when ``observe`` (or
    ``observer``) was replaced on the instance, or by a subclass that inherited the plan."""
    if "observe" in vars(det) or "observer" in vars(det):
        return False
    cls = type(det)
    owns = _OWNS.get(cls)
    if owns is None:
        where = {name: next(c for c in cls.__mro__ if name in vars(c)) for name in ("plan", "observe", "observer")}
        owns = _OWNS[cls] = where["plan"] is where["observe"] and where["observer"] in (where["plan"], Detector)
    return owns


_OWNS: dict[type, bool] = {}
_NONE: frozenset[str] = frozenset()


def _live(table: dict[str, "tuple[Entry, ...]"], bulk: dict[int, list[Any]]) -> dict[str, "tuple[Entry, ...]"]:
    return {m: tuple(e for e in entries if id(e[0]) not in bulk) for m, entries in table.items()}
