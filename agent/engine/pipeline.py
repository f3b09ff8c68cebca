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
from typing import Any, Callable, Iterable

from .alerts import AlertBook
from ..detectors import Clear, Detector, Hit
from ..store.memory import (WHOLE, CodecError, decode, decode_record, digest, dump_key, dumps, encode, encode_record,
                     explicit, load_key, loads, rule_keys, slots_of)
from ..model import HINT_METRICS, Finding, Labels, Sample
from .rulefile import Rule, RuleSet
from ..series.state import SeriesState

log = logging.getLogger(__name__)

DISPATCH_MAX = 1 << 16  # (metric, series) -> rules entries kept before the cache starts over


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
        # run-wide facts (precision, end of training) by run: the series' labels less ``rank``
        self._run_hints: OrderedDict[Labels, dict[str, Sample]] = OrderedDict()
        self._rules_by_name: dict[str, Rule] = {}
        self.memory = MemoryBook()  # detector memory for the state store (below)
        self._cleared_saved: dict[str, float] = {}
        self.memory.extra["@alerts"] = (self._cleared_rows, self.alerts.restore_cleared)
        self.set_rules(rules)

    def set_rules(self, rules: RuleSet) -> None:
        with self.lock:
            self.rules = rules
            self._dispatch: dict[tuple[str, Labels], tuple[Rule, ...]] = {}
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
        out: list[Finding] = []
        with self.lock:
            dispatch = self._dispatch
            for sample in samples:
                if sample.metric in HINT_METRICS:
                    self._hint(sample)
                    continue
                series = self.series_for(sample.labels)
                self.dirty_series.add(sample.labels)
                attempt = series.attempt
                accepted_samples = series.ingest(sample)
                if series.attempt != attempt:
                    self._new_attempt(series.labels, sample.time)
                for accepted in accepted_samples:
                    if self.on_accepted is not None:
                        self.on_accepted(accepted, series)
                    key = (accepted.metric, accepted.labels)
                    rules = dispatch.get(key)
                    if rules is None:
                        rules = self._rules_for(key)
                    for rule in rules:
                        try:
                            signal = rule.detector.observe(accepted, series)
                        except Exception as exc:  # one broken rule must not stop the others
                            self._detector_failed(rule, exc)
                            continue
                        if signal is None:  # most samples change nothing
                            continue
                        f = self._signal(rule, signal, accepted.time)
                        if f is not None:
                            out.append(f)
        return out

    def _rules_for(self, key: tuple[str, Labels]) -> tuple[Rule, ...]:
        """The rules that judge a metric of a series (their matchers asked once per series)."""
        if len(self._dispatch) >= DISPATCH_MAX:
            self._dispatch.clear()
        rules = self._dispatch[key] = tuple(r for r in self.rules.rules_for(key[0]) if r.matches(key[1]))
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


# -- the book: what changed since the last commit, and putting it back at start ------------------
@dataclasses.dataclass
class MemoryDelta:
    """Rows for one state-store commit."""

    upserts: list[tuple[str, str, str, str, str, int]]  # rule, slot, key, digest, data, seq
    deletes: list[tuple[str, str, str]]                  # rule, slot, key
    clear: list[tuple[str, str | None]]                  # rule, slot (None: all of the rule's rows)
    keep: dict[str, str] | None = None                   # set: delete rows of other rules or digests

    def __bool__(self) -> bool:
        return bool(self.upserts or self.deletes or self.clear or self.keep is not None)


Getter = Callable[[bool], Any]   # full -> data to store, or None when unchanged
Restorer = Callable[[Any], None]


class MemoryBook:
    """Tracks the rules in force and turns their detectors' memory into rows and back."""

    def __init__(self) -> None:
        self.entries: list[tuple[Rule, str, str]] = []  # rule, key, digest
        self.errors: list[str] = []   # unreadable or unstorable memory; the owner counts them
        self.extra: dict[str, tuple[Getter, Restorer]] = {}  # non-rule memory (the alert book's)
        self._prune = True            # next commit: delete rows of removed or edited rules
        self._full = False            # next commit: rewrite everything (after a failed commit)
        self._clear_rules: set[str] = set()
        self._failed: set[str] = set()
        self._seq = 0
        # hash of the row last written per (rule, slot, series key): a detector that touches its
        # memory without changing it (stalled's tick, every evaluation interval) writes nothing,
        # so an idle agent does not commit (and fsync) every few seconds
        self._written: dict[tuple[str, str, str], int] = {}

    def set_rules(self, rules: list[Rule]) -> list[Rule]:
        """Take the rules in force. A rule rebuilt by a reload but unchanged keeps its memory;
        returns the rules that existed before with other parameters (they start empty)."""
        old = {key: (dig, r.detector) for r, key, dig in self.entries}
        self.entries = [(r, key, digest(r)) for r, key in rule_keys(rules)]
        edited = []
        kept: set[str] = set()
        for r, key, dig in self.entries:
            prev = old.get(key)
            if prev is None:
                continue
            if prev[1] is r.detector or (prev[0] == dig and type(prev[1]) is type(r.detector)):
                if prev[1] is not r.detector:
                    vars(r.detector).update(vars(prev[1]))
                kept.add(key)
            else:
                edited.append(r)
        # rows of rules that are new, edited or removed are deleted by the prune: forget what was
        # written for them, or a new record equal to an old one would be skipped and never stored
        self._written = {w: h for w, h in self._written.items() if w[0] in kept}
        self._failed &= kept
        self._prune = True
        return edited

    def collect(self) -> MemoryDelta:
        """The rows that changed since the last call (all of them after ``requeue``)."""
        delta = MemoryDelta([], [], [])
        full, self._full = self._full, False
        if self._prune or full:
            delta.keep = {key: dig for _, key, dig in self.entries} | {k: "" for k in self.extra}
            self._prune = False
        delta.clear += [(key, None) for key in sorted(self._clear_rules)]
        if full:
            self._written.clear()
        elif self._clear_rules:
            self._written = {k: h for k, h in self._written.items() if k[0] not in self._clear_rules}
        self._clear_rules.clear()
        for rule, key, dig in self.entries:
            if key in self._failed:
                continue
            part = MemoryDelta([], [], [])
            try:
                self._collect(rule.detector, key, dig, full, part)
            except CodecError as exc:
                self._failed.add(key)
                delta.clear.append((key, None))
                self.errors.append(f"memory of rule {rule.name} cannot be stored ({exc}); "
                                   "it will start empty after a restart")
                continue
            delta.upserts += part.upserts
            delta.deletes += part.deletes
            delta.clear += part.clear
        for key, (get, _) in self.extra.items():
            data = get(full)
            if data is not None:
                delta.upserts.append((key, WHOLE, "", "", dumps(encode(data)), self._next()))
        return delta

    def _collect(self, det: Detector, key: str, dig: str, full: bool, out: MemoryDelta) -> None:
        for slot, ps in slots_of(det).items():
            force = full or ps.reset
            if force:
                out.clear.append((key, slot))
                self._written = {w: h for w, h in self._written.items() if w[:2] != (key, slot)}
                keys: Iterable[Labels] = [k for k, _ in ps.items()]
            else:
                for k in ps.removed:
                    lk = dump_key(k)
                    self._written.pop((key, slot, lk), None)
                    out.deletes.append((key, slot, lk))
                keys = ps.changed if 4 * len(ps.changed) < len(ps) else \
                    [k for k, _ in ps.items() if k in ps.changed]  # LRU order, cheaply
            for k in keys:
                v = ps.value(k)
                if v is not None:
                    lk = dump_key(k)
                    data = dumps(encode_record(ps.factory, v))
                    h = hash(data)
                    if not force and self._written.get((key, slot, lk)) == h:
                        continue  # touched, not changed
                    self._written[(key, slot, lk)] = h
                    out.upserts.append((key, slot, lk, dig, data, self._next()))
            ps.persisted()
        if explicit(det) and (full or det.memory_dirty):
            out.upserts.append((key, WHOLE, "", dig, dumps(encode(det.state())), self._next()))
            det.memory_dirty = False

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def requeue(self, delta: MemoryDelta) -> None:
        """The commit of ``delta`` failed: the next one rewrites everything."""
        self._full = True
        self._written.clear()
        self._clear_rules |= {key for key, slot in delta.clear if slot is None}

    def restore(self, rows: Iterable[tuple[str, str, str, str, str, int]]) -> list[Rule]:
        """Put stored rows (ordered by seq) back into the detectors. Rows of removed rules are
        ignored (the first commit deletes them); a rule whose rows carry another digest, or one
        of whose rows does not decode, starts empty. Returns those rules."""
        by_key = {key: (r, dig) for r, key, dig in self.entries}
        grouped: dict[str, list[tuple[str, str, str, str, str, int]]] = {}
        for row in rows:
            grouped.setdefault(row[0], []).append(row)
            self._seq = max(self._seq, int(row[5]))
        dropped: list[Rule] = []
        for key, rs in grouped.items():
            if key in self.extra:
                try:
                    self.extra[key][1](decode(loads(rs[-1][4])))
                except (CodecError, ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError,
                        RecursionError) as exc:
                    self.errors.append(f"stored memory {key} is unreadable ({exc}); ignored")
                continue
            if key not in by_key:
                continue
            rule, dig = by_key[key]
            if any(r[3] != dig for r in rs):
                dropped.append(rule)  # edited between runs: its old memory means something else
                continue
            try:
                self._restore(rule.detector, rs)
            except (CodecError, ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError,
                    RecursionError) as exc:
                fresh = type(rule.detector)(rule.detector.params)
                vars(rule.detector).clear()
                vars(rule.detector).update(vars(fresh))
                self._clear_rules.add(key)
                dropped.append(rule)
                self.errors.append(f"stored memory of rule {rule.name} is unreadable "
                                   f"({type(exc).__name__}: {str(exc)[:200]}); the rule starts empty")
        return dropped

    @staticmethod
    def _restore(det: Detector, rows: list[tuple[str, str, str, str, str, int]]) -> None:
        slots = slots_of(det)
        for _, slot, raw_key, _, data, _ in rows:
            if slot == WHOLE:
                if not explicit(det):
                    raise CodecError("whole-detector memory for a kind without state()")
                det.restore(decode(loads(data)))
                continue
            ps = slots.get(slot)
            if ps is None:
                raise CodecError(f"unknown memory slot {slot!r}")
            ps.restore(load_key(raw_key), decode_record(ps.factory, loads(data)))


def run_of(labels: Labels) -> Labels:
    """The run a series belongs to: its labels less ``rank`` (one series per rank of a run)."""
    return tuple(kv for kv in labels if kv[0] != "rank")


def _alert_labels(series: Labels, rule: Rule) -> Labels:
    """An alert's labels: its series' labels overlaid with the rule's own labels."""
    return tuple(sorted((dict(series) | rule.spec.labels).items()))
