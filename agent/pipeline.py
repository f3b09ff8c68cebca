"""The one pipeline: samples → series state → detectors → findings → alert book.

The daemon, ``replay`` and ``demo`` all drive this class; none of them has its own detection
code. It is single-threaded by design: the daemon's worker thread owns it, and readers of its
state (the HTTP exporter) take ``snapshot()`` copies under ``lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable

from .alerts import AlertBook
from .detectors import Clear, Detector, Hit
from .memory import MemoryBook, MemoryDelta
from .model import Finding, Labels, Sample
from .rulefile import Rule, RuleSet
from .series import SeriesState

log = logging.getLogger(__name__)


class Pipeline:
    def __init__(self, rules: RuleSet, max_series: int = 512, keep_findings: int = 0) -> None:
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
        self._rules_by_name: dict[str, Rule] = {}
        self.memory = MemoryBook()  # detector memory for the state store (agent/memory.py)
        self._cleared_saved: dict[str, float] = {}
        self.memory.extra["@alerts"] = (self._cleared_rows, self.alerts.restore_cleared)
        self.set_rules(rules)

    def set_rules(self, rules: RuleSet) -> None:
        with self.lock:
            self.rules = rules
            self._rules_by_name = {r.name: r for r in rules.rules}
            # only kinds that override tick() are asked every evaluation interval
            self._tick_rules = [r for r in rules.rules if type(r.detector).tick is not Detector.tick]
            for r in rules.rules:
                self.findings_total.setdefault(r.name, 0)
            for r in self.memory.set_rules(rules.rules):  # edited rules start with empty memory
                self._memory_lost(r, time.time())

    # -- detector memory (persisted with offsets and alerts) ----------------------------------------
    def memory_delta(self) -> MemoryDelta:
        """What the next state commit must write of the detectors' memory."""
        with self.lock:
            return self.memory.collect()

    def restore_memory(self, rows: list[tuple[str, str, str, str, str, int]], now: float) -> None:
        """Put the memory of the last run back into the detectors of the rules in force."""
        with self.lock:
            for r in self.memory.restore(rows):
                self._memory_lost(r, now)

    def _memory_lost(self, rule: Rule, now: float) -> None:
        if rule.detector.stateful:
            self.alerts.resolve_rule(rule.name, now)

    def _cleared_rows(self, full: bool) -> dict[str, float] | None:
        cur = self.alerts.cleared_since()
        if not full and cur == self._cleared_saved:
            return None
        self._cleared_saved = cur
        return cur

    def series_for(self, labels: Labels) -> SeriesState:
        st = self.series.get(labels)
        if st is None:
            if len(self.series) >= self.max_series:
                self.series.popitem(last=False)  # least recently updated
                self.evicted_series += 1
            st = self.series[labels] = SeriesState(labels)
        else:
            self.series.move_to_end(labels)
        return st

    def process(self, samples: Iterable[Sample]) -> list[Finding]:
        out: list[Finding] = []
        with self.lock:
            for sample in samples:
                series = self.series_for(sample.labels)
                self.dirty_series.add(sample.labels)
                for accepted in series.ingest(sample):
                    if self.on_accepted is not None:
                        self.on_accepted(accepted, series)
                    for rule in self.rules.rules_for(accepted.metric):
                        if not rule.matches(accepted.labels):
                            continue
                        try:
                            signal = rule.detector.observe(accepted, series)
                        except Exception as exc:  # one broken rule must not stop the others
                            self._detector_failed(rule, exc)
                            continue
                        f = self._signal(rule, signal, accepted.time)
                        if f is not None:
                            out.append(f)
        return out

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


def _alert_labels(series: Labels, rule: Rule) -> Labels:
    """An alert's labels: its series' labels overlaid with the rule's own labels."""
    return tuple(sorted((dict(series) | rule.spec.labels).items()))
