"""The one pipeline: samples → series state → detectors → findings → alert book.

The daemon, ``replay`` and ``demo`` all drive this class; none of them has its own detection
code. It is single-threaded by design: the daemon's worker thread owns it, and readers of its
state (the HTTP exporter) take ``snapshot()`` copies under ``lock``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Protocol

from .alerts import AlertBook
from .catchup import RUN_MAX, judge_run
from ..detectors import Clear, Detector, Hit
from ..detectors.base import slots_of
from ..model import HINT_METRICS, UNSERIED_METRICS, Alert, Finding, Labels, Sample, gc_paused
from .rulefile import Rule, RuleSet
from .suspect import SuspectJudge
from ..series.state import SeriesState

log = logging.getLogger(__name__)

_APART = HINT_METRICS | UNSERIED_METRICS  # samples judged on their own, between runs


class DetectorMemory(Protocol):
    """What the pipeline asks of a detector memory book (store/book.py: ``MemoryBook``)."""

    extra: dict[str, tuple[Callable[[bool], Any], Callable[[Any], None]]]
    unreadable: list[Rule]  # rules whose stored memory did not decode (filled by restore)
    bad_rows: list[tuple[tuple[str, str, str, str, str, int], str]]  # those rows and why: the owner quarantines them

    def set_rules(self, rules: list[Rule]) -> list[Rule]: ...
    def collect(self) -> Any: ...
    def restore(self, rows: Iterable[tuple[str, str, str, str, str, int]]) -> list[Rule]: ...


@dataclasses.dataclass
class StateChanges:
    """What the next state commit writes of the pipeline (besides detector memory): alerts changed
    or deleted, and series changed, since the last commit."""

    alerts: list[Alert]
    deleted_alerts: set[str]
    series: list[SeriesState]
    pending: bool

    def __bool__(self) -> bool:
        return self.pending


# one rule of a series' table: the rule, its detector's observer, its bit where a record's first
# sample of the metric is all it needs (Detector.once_per_record), else 0
Entry = tuple[Rule, Callable[[Sample, SeriesState], Any], int]
DISPATCH_MAX = 1 << 14  # series whose rule tables are kept before the cache starts over


class Pipeline:
    def __init__(self, rules: RuleSet, max_series: int = 512, keep_findings: int = 0,
                 memory: DetectorMemory | None = None) -> None:
        """``memory``: the detectors' memory book (store/book.py) of an owner that persists it or
        reloads rules (the daemon); without one, a rule set replaced keeps no detector state."""
        self.rules = rules
        self.alerts = AlertBook()
        self.series: OrderedDict[Labels, SeriesState] = OrderedDict()
        self.max_series = max_series
        self.evicted_series = 0
        self.findings_total: dict[str, int] = {}
        self.keep_findings = keep_findings          # replay keeps every finding; the daemon none
        self.findings: list[Finding] = []
        self.on_accepted: Callable[[Sample, SeriesState], None] | None = None  # replay's tap
        self.errors: list[str] = []  # detector failures, drained by the owner (counted as errors)
        self.dirty_series: set[Labels] = set()  # series changed since the last state commit
        self.lock = threading.RLock()
        # run-wide facts (precision, end of training) by run: the series' labels less ``rank``
        self._run_hints: OrderedDict[Labels, dict[str, Sample]] = OrderedDict()
        self._rules_by_name: dict[str, Rule] = {}
        self.memory = memory
        self.suspects = SuspectJudge()  # the suspect label of incident alerts, and its host ledger
        self._cleared_saved: dict[str, float] = {}
        if memory is not None:
            memory.extra["@alerts"] = (self._cleared_rows, self.alerts.restore_cleared)
            memory.extra["@hardware"] = (self.suspects.ledger.rows, self.suspects.ledger.restore)
        self.set_rules(rules)

    def set_rules(self, rules: RuleSet) -> None:
        with self.lock:
            self.rules = rules
            # labels -> metric -> the rules that judge it (``_add``); series that the rules' label
            # matchers treat alike share one table (``_shared``, by the matchers they pass)
            self._tables: dict[Labels, dict[str, tuple[Entry, ...]]] = {}
            self._shared: dict[tuple[int, ...], dict[str, tuple[Entry, ...]]] = {}
            self._matching = [r for r in rules.rules if r.matchers]
            self._bits = {id(r): 1 << i for i, r in enumerate(rules.rules)}
            self._rules_by_name = {r.name: r for r in rules.rules}
            # only kinds that override tick() are asked every evaluation interval
            self._tick_rules = [r for r in rules.rules if type(r.detector).tick is not Detector.tick]
            for r in rules.rules:
                self.findings_total.setdefault(r.name, 0)
            if self.memory is not None:
                for r in self.memory.set_rules(rules.rules):  # edited rules start with empty memory
                    self._memory_lost(r, time.time())

    # -- detector memory (persisted with offsets and alerts) ----------------------------------------
    def memory_delta(self) -> Any:
        """What the next state commit must write of the detectors' memory (store/book.py)."""
        if self.memory is None:
            raise RuntimeError("this pipeline keeps no detector memory book")
        with self.lock:
            return self.memory.collect()

    def restore_memory(self, rows: list[tuple[str, str, str, str, str, int]], now: float) -> None:
        """Put the memory of the last run back into the detectors of the rules in force."""
        if self.memory is None:
            raise RuntimeError("this pipeline keeps no detector memory book")
        with self.lock:
            for r in self.memory.restore(rows):
                self._memory_lost(r, now)
            for r in self.memory.unreadable:  # damaged, not changed: its pages are kept
                if r.detector.stateful:
                    self.alerts.memory_lost(r.name, now)
            self.memory.unreadable.clear()

    def _memory_lost(self, rule: Rule, now: float) -> None:
        if rule.detector.stateful:
            self.alerts.resolve_rule(rule.name, now)

    def _cleared_rows(self, full: bool) -> dict[str, float] | None:
        cur = self.alerts.cleared_since()
        if not full and cur == self._cleared_saved:
            return None
        self._cleared_saved = cur
        return cur

    def state_changes(self) -> StateChanges:
        """Alerts and series changed since the last commit (the series are taken: a failed commit
        writes them again only when they change again; alerts stay dirty until ``alerts.committed()``)."""
        book = self.alerts
        if not (book.dirty or book.deleted or self.dirty_series):
            return StateChanges([], set(), [], False)
        with self.lock:
            alerts = [book.alerts[f] for f in book.dirty if f in book.alerts]
            series = [self.series[k] for k in self.dirty_series if k in self.series]
            self.dirty_series.clear()
        return StateChanges(alerts, set(book.deleted), series, True)

    def series_for(self, labels: Labels) -> SeriesState:
        st = self.series.get(labels)
        if st is None:
            if len(self.series) >= self.max_series:
                self.series.popitem(last=False)  # least recently updated
                self.evicted_series += 1
            st = self.series[labels] = SeriesState(labels)
            run = run_of(labels)
            hints = self._run_hints.get(run)
            if hints is not None:
                for hint in hints.values():
                    st.apply_hint(hint)
            else:  # after a restart the hints are gone, but the run's restored series still know
                sib = next((o for k, o in self.series.items() if k != labels and run_of(k) == run
                            and (o.precision or o.scaler)), None)
                if sib is not None:
                    st.precision, st.scaler = sib.precision, sib.scaler
        else:
            self.series.move_to_end(labels)
        return st

    def _hint(self, sample: Sample) -> None:
        """A run-wide fact: every series of the run takes it, and so will the run's later ones."""
        run = run_of(sample.labels)
        hints = self._run_hints.get(run)
        if hints is None:
            if len(self._run_hints) >= self.max_series:
                self._run_hints.popitem(last=False)
            hints = self._run_hints[run] = {}
        else:
            self._run_hints.move_to_end(run)
        hints[sample.metric] = sample
        for labels, st in self.series.items():
            if labels == run or run_of(labels) == run:
                st.apply_hint(sample)
                self.dirty_series.add(labels)

    def _new_attempt(self, labels: Labels, now: float) -> None:
        """The series' steps went back: its detectors' memory belongs to the attempt before, and
        so do the conditions its state alerts stood for (they clear; the new attempt's data fires
        them again if they hold)."""
        for rule in self.rules.rules:
            for ps in slots_of(rule.detector).values():
                ps.drop(labels)
            if rule.detector.stateful and rule.matches(labels):
                self.alerts.clear(rule, _alert_labels(labels, rule), now)

    def process(self, samples: Iterable[Sample]) -> list[Finding]:
        """Judge ``samples`` in order. The samples of one series in a row (the values of a record,
        the records of a file) are judged as one run (agent/engine/catchup.py): the run finds its
        series and its table of rules once, a rule that needs one sample of a record
        (``Detector.once_per_record``) observes only the first it is given, and a long run (a
        backlog) leaves each rule out of the per-sample loop for as long as its plan
        (``Detector.plan``) proves it would say nothing."""
        out: list[Finding] = []
        with self.lock, gc_paused():
            run: list[Sample] = []
            cur: Labels | None = None  # the labels object of the run in hand
            for sample in samples:
                metric = sample.metric
                if metric in _APART:
                    if run:
                        self._run(cur, run, out)  # type: ignore[arg-type]
                        run = []
                    if metric in HINT_METRICS:
                        self._hint(sample)
                    else:  # reader health, host faults: judged, no series kept
                        self.suspects.ledger.note(sample)  # device faults, rerun verdicts: suspect.py
                        self._judge(sample, SeriesState(sample.labels), self._rules(sample.labels, metric), out)
                    continue
                labels = sample.labels
                if labels is not cur or len(run) >= RUN_MAX:
                    if run:
                        self._run(cur, run, out)  # type: ignore[arg-type]
                        run = []
                    cur = labels
                run.append(sample)
            if run:
                self._run(cur, run, out)  # type: ignore[arg-type]
        return out

    def _run(self, labels: Labels, run: list[Sample], out: list[Finding]) -> None:
        """A run of samples of one series (``labels``, the same object for each): catchup.py."""
        series = self.series_for(labels)
        self.dirty_series.add(labels)
        judge_run(self, labels, series, self._tables.get(labels) or self._table_for(labels), run, out)

    def _judge(self, sample: Sample, series: SeriesState, rules: tuple[Entry, ...], out: list[Finding]) -> None:
        """Every rule of ``rules`` observes one accepted sample; their findings go to ``out``."""
        for rule, observe, _bit in rules:
            try:
                signal = observe(sample, series)
            except Exception as exc:  # one broken rule must not stop the others
                self._detector_failed(rule, exc)
                continue
            if signal is not None:  # most samples change nothing
                self._signals(rule, signal, sample.time, out)

    def _signals(self, rule: Rule, signal: Hit | Clear | list[Hit | Clear], now: float, out: list[Finding]) -> None:
        # an incident kind may answer several: the incident before ends, a new one opens
        for one in signal if isinstance(signal, list) else (signal,):
            f = self._signal(rule, one, now)
            if f is not None:
                out.append(f)

    def _table_for(self, labels: Labels) -> dict[str, tuple[Entry, ...]]:
        """The series' table: metric -> the rules that judge it (``_add``). The rules' matchers
        are asked once per series; the series whose labels pass the same matchers (most: the
        shipped rules match every series) share one table, so a followed file costs one entry
        here, not a table of its own."""
        table = self._tables.get(labels)
        if table is None:
            if len(self._tables) >= DISPATCH_MAX:
                self._tables.clear()
                self._shared.clear()
            key = tuple(i for i, r in enumerate(self._matching) if r.matches(labels))
            table = self._shared.get(key)
            if table is None:
                table = self._shared[key] = {}
            self._tables[labels] = table
        return table

    def _rules(self, labels: Labels, metric: str) -> tuple[Entry, ...]:
        rules = self._table_for(labels).get(metric)
        return rules if rules is not None else self._add(labels, metric)

    def _add(self, labels: Labels, metric: str) -> tuple[Entry, ...]:
        """Each rule that judges ``metric`` of the series, with its detector's observer and, where
        one sample of a record is all it needs of this metric, its own bit (else 0)."""
        rules = self._table_for(labels)[metric] = tuple(
            (r, r.detector.observer(), self._bits[id(r)] if r.detector.once_per_record(metric) else 0)
            for r in self.rules.rules_for(metric) if r.matches(labels))
        return rules

    def _detector_failed(self, rule: Rule, exc: Exception) -> None:
        log.exception("rule %s (%s) failed", rule.name, rule.spec.kind)
        self.errors.append(f"rule {rule.name} ({rule.spec.kind}) failed: {exc!r}")

    def _signal(self, rule: Rule, signal: Hit | Clear | None, now: float) -> Finding | None:
        if isinstance(signal, Hit):
            return self._finding(rule, signal, now)
        if isinstance(signal, Clear):
            self.alerts.clear(rule, _alert_labels(signal.labels, rule), now)
        return None

    def _finding(self, rule: Rule, hit: Hit, now: float) -> Finding | None:
        labels = _alert_labels(hit.labels, rule)
        f = Finding(rule=rule.name, kind=rule.spec.kind, severity=rule.severity, labels=labels,
                    summary=hit.message, time=now, step=hit.step, source=hit.source, value=hit.value,
                    evidence=hit.evidence,
                    annotations=rule.annotate(labels, hit.value, hit.step, hit.source, hit.evidence))
        if self.suspects.judges(rule):  # incident rules: hardware, numerics or unknown
            f = self.suspects.judged(rule, f, self.alerts.alerts, self.series)
        _alert, onset = self.alerts.hit(rule, f)
        if rule.detector.stateful and not onset:
            return None  # a state that still holds (scale still at the floor) is not a new finding
        self.findings_total[rule.name] = self.findings_total.get(rule.name, 0) + 1
        if self.keep_findings and len(self.findings) < self.keep_findings:
            self.findings.append(f)
        return f

    def expire(self, now: float, ttl: float) -> list[Labels]:
        """Forget series without a record for ``ttl`` seconds (finished runs), so their
        metrics disappear and stale-series alerts end; their alerts resolve as usual."""
        with self.lock:
            old = [k for k, s in self.series.items() if s.last_update and now - s.last_update > ttl]
            for k in old:
                del self.series[k]
                self.dirty_series.discard(k)
            return old

    def tick(self, now: float) -> None:
        with self.lock:
            for rule in self._tick_rules:
                for series in self.series.values():
                    if rule.matches(series.labels):
                        try:
                            signal = rule.detector.tick(now, series)
                        except Exception as exc:
                            self._detector_failed(rule, exc)
                            continue
                        self._signal(rule, signal, now)
            self.alerts.tick(self._rules_by_name, now)


def run_of(labels: Labels) -> Labels:
    """The run a series belongs to: its labels less ``rank`` (one series per rank of a run)."""
    return tuple(kv for kv in labels if kv[0] != "rank")


def _alert_labels(series: Labels, rule: Rule) -> Labels:
    """An alert's labels: its series' labels overlaid with the rule's own labels."""
    return tuple(sorted((dict(series) | rule.spec.labels).items()))
