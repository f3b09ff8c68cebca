"""Alert lifecycle: pending → firing → resolved, one alert per rule and label set.

Semantics follow Prometheus: a condition must hold for the rule's ``for`` before the alert
fires; ``keep_firing_for`` delays resolution. Event-like kinds (a NaN appeared) resolve once
``resolve_after`` passes without another hit; state-like kinds (scale at floor) resolve when
their detector says the condition stopped. Every change is recorded as a transition so that
exporters (log, Alertmanager) see each one exactly once, and dirty alerts are persisted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import Alert, AlertState, Finding, Labels, fingerprint
from .rulefile import Rule
from .suspect import identity, later

# set in an alert's finding when its rule's stored memory was unreadable at start (the time)
MEMORY_LOST = "memory_lost_at"
RESOLVED_RETENTION_S = 900.0  # keep resolved alerts visible (API, Alertmanager resend) this long


@dataclass(frozen=True, slots=True)
class Transition:
    alert: Alert
    old: AlertState | None
    new: AlertState


class AlertBook:
    def __init__(self) -> None:
        self.alerts: dict[str, Alert] = {}
        self.dirty: set[str] = set()
        self.deleted: set[str] = set()
        self._transitions: list[Transition] = []
        self._cleared: dict[str, float] = {}  # fingerprint -> time the condition stopped
        # rule -> identity labels -> fingerprint of its alerts not resolved: a detector clears
        # every series it judges, and a clear of a rule without an open alert for those labels
        # (nearly all of them) is answered here without hashing (``model.fingerprint``) the labels
        self._open: dict[str, dict[Labels, str]] = {}
        # alerts that time alone may change (``tick`` visits only these): a firing alert of a
        # state kind, not cleared, waits for its detector's hit or clear, however many there are
        self._due: set[str] = set()
        self._rules_seen: dict[str, Rule] | None = None   # the rules of the last tick

    # -- inputs ------------------------------------------------------------------------------
    def hit(self, rule: Rule, finding: Finding) -> tuple[Alert, bool]:
        """Record a hit; returns the alert and whether this hit opened it (an onset)."""
        fp = fingerprint(rule.name, identity(finding.labels))  # the suspect label never splits an alert
        now = finding.time
        a = self.alerts.get(fp)
        onset = a is None or a.state == AlertState.RESOLVED
        if onset:
            a = Alert(fp, rule.name, finding.labels, AlertState.PENDING, now, now,
                      annotations=dict(finding.annotations), finding=finding.to_json(), count=0)
            self.alerts[fp] = a
            self._opened(a)
            self._transitions.append(Transition(a, None, AlertState.PENDING))
        a.last_seen = now
        a.count += 1
        if not onset and "incident" in finding.evidence:
            # an incident kind (agent/detectors/dump_incident.py) sends the whole incident each time:
            # its origin may move to an earlier step or rank, its affected steps grow
            a.annotations = dict(finding.annotations)
            a.finding = finding.to_json()
        elif not onset:
            later(a, finding)  # the suspect verdict as it stands now, beside the onset's
        # Otherwise the evidence and annotations stay those of the onset (the first bad step is
        # what a responder needs); the latest occurrence is kept beside them.
        a.finding["latest"] = {"step": finding.step, "value": finding.value, "time": now,
                               "line": finding.source.line if finding.source else None}
        self._cleared.pop(fp, None)
        a.finding.pop(MEMORY_LOST, None)  # the detector knows the state again
        self.dirty.add(fp)
        self._due.add(fp)
        self._promote(a, rule, now)
        return a, onset

    def clear(self, rule: Rule, labels: Labels, now: float) -> None:
        # = fingerprint(rule.name, identity(labels)) of an open alert; a rule or series carrying
        # its own ``suspect`` label is indexed without it, as ``hit`` keys it
        fp = self._open.get(rule.name, {}).get(identity(labels))
        a = self.alerts.get(fp) if fp is not None else None
        if a is None or a.state == AlertState.RESOLVED:
            return
        if a.state == AlertState.PENDING:
            self._drop(fp)
            return
        self._cleared.setdefault(fp, now)
        self._due.add(fp)
        self._maybe_resolve(a, rule, now)

    def tick(self, rules_by_name: dict[str, Rule], now: float) -> None:
        """Time-driven changes: for: elapsed, resolve_after elapsed, retention of resolved. Visits
        the alerts time may change; after a rule reload every one once. A reload is seen as a new
        ``rules_by_name`` object (Pipeline.set_rules builds one): never change it in place."""
        if rules_by_name is not self._rules_seen:
            self._rules_seen = rules_by_name
            self._due.update(self.alerts)
        due = self._due
        for fp in [fp for fp in self.alerts if fp in due]:   # in the alerts' order, as a full pass
            a = self.alerts.get(fp)
            if a is None or not self._tick_one(fp, a, rules_by_name.get(a.rule), now):
                due.discard(fp)

    def _tick_one(self, fp: str, a: Alert, rule: Rule | None, now: float) -> bool:
        """One alert's time-driven change; whether time alone may still change it (else only a
        hit, a clear or a reload will)."""
        if a.state == AlertState.RESOLVED:
            if a.resolved_at is not None and now - a.resolved_at > RESOLVED_RETENTION_S:
                self._drop(fp)
                return False
            return True
        if rule is None:  # its rule was removed: resolve rather than fire forever
            self._resolve(a, now)
            return True
        lost = a.finding.get(MEMORY_LOST)
        lost = lost if type(lost) in (int, float) else None
        if ((not rule.detector.stateful or lost is not None)
                and now - max(a.last_seen, lost or 0.0) >= rule.resolve_after):
            if a.state == AlertState.PENDING:
                self._drop(fp)
                return False
            self._cleared.setdefault(fp, max(a.last_seen, lost or 0.0) + rule.resolve_after)
        if a.state == AlertState.PENDING:
            self._promote(a, rule, now)
        elif fp in self._cleared:
            self._maybe_resolve(a, rule, now)
        return (a.state != AlertState.FIRING or not rule.detector.stateful or lost is not None
                or fp in self._cleared)

    # -- outputs -----------------------------------------------------------------------------
    def committed(self) -> None:
        """The state store holds every dirty and deleted alert now."""
        self.dirty.clear()
        self.deleted.clear()

    def drain_transitions(self) -> list[Transition]:
        out, self._transitions = self._transitions, []
        return out

    def active(self) -> list[Alert]:
        return [a for a in self.alerts.values() if a.state != AlertState.RESOLVED]

    def load(self, alerts: list[Alert]) -> None:
        for a in alerts:
            old = self.alerts.get(a.fingerprint)
            if old is not None:
                self._closed(old)
            self.alerts[a.fingerprint] = a
            self._due.add(a.fingerprint)
            if a.state != AlertState.RESOLVED and a.fingerprint == fingerprint(a.rule, identity(a.labels)):
                self._opened(a)  # (a row whose fingerprint is not its labels' was never cleared)

    def cleared_since(self) -> dict[str, float]:
        """When each firing alert's condition stopped (waiting out ``keep_firing_for``): persisted
        with the detector memory, or a restart in that wait would keep the alert firing forever."""
        return dict(self._cleared)

    def restore_cleared(self, data: object) -> None:
        if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
            raise ValueError("expected {fingerprint: time}")
        restored = {str(k): float(v) for k, v in data.items() if k in self.alerts}
        self._cleared.update(restored)
        self._due.update(restored)

    def memory_lost(self, name: str, now: float) -> None:
        """The rule's stored memory was unreadable (a damaged row): its detector starts empty and
        will not clear what it no longer knows. Its active alerts are kept, but resolve as an
        event's do, ``resolve_after`` without a new hit (counted from now); a hit means the
        detector learnt the state again, and its own clear ends the alert from then on."""
        for fp, a in list(self.alerts.items()):
            if a.rule == name and a.state != AlertState.RESOLVED:
                a.finding[MEMORY_LOST] = now
                self.dirty.add(fp)
                self._due.add(fp)

    def resolve_rule(self, name: str, now: float) -> None:
        """The rule's detector lost its memory (edited, or unreadable memory): a stateful alert
        could never be cleared again, so it resolves now (and fires anew if the condition holds)."""
        for fp, a in list(self.alerts.items()):
            if a.rule != name or a.state == AlertState.RESOLVED:
                continue
            if a.state == AlertState.PENDING:
                self._drop(fp)
            else:
                self._resolve(a, now)

    # -- internals ---------------------------------------------------------------------------
    def _promote(self, a: Alert, rule: Rule, now: float) -> None:
        if a.state == AlertState.PENDING and now - a.active_at >= rule.spec.for_:
            a.state = AlertState.FIRING
            a.fired_at = now
            self.dirty.add(a.fingerprint)
            self._transitions.append(Transition(a, AlertState.PENDING, AlertState.FIRING))

    def _maybe_resolve(self, a: Alert, rule: Rule, now: float) -> None:
        since = self._cleared.get(a.fingerprint, now)
        if now - since >= rule.spec.keep_firing_for:
            self._resolve(a, now)

    def _opened(self, a: Alert) -> None:
        self._open.setdefault(a.rule, {})[identity(a.labels)] = a.fingerprint

    def _closed(self, a: Alert) -> None:
        mine = self._open.get(a.rule)
        if mine is not None and mine.get(key := identity(a.labels)) == a.fingerprint:
            del mine[key]
            if not mine:
                del self._open[a.rule]

    def _resolve(self, a: Alert, now: float) -> None:
        old = a.state
        self._closed(a)
        a.state = AlertState.RESOLVED
        a.resolved_at = now
        self._cleared.pop(a.fingerprint, None)
        self.dirty.add(a.fingerprint)
        self._due.add(a.fingerprint)   # kept RESOLVED_RETENTION_S, then dropped
        self._transitions.append(Transition(a, old, AlertState.RESOLVED))

    def _drop(self, fp: str) -> None:
        a = self.alerts.pop(fp, None)
        if a is not None:
            self._closed(a)
        self._cleared.pop(fp, None)
        self._due.discard(fp)
        self.dirty.discard(fp)
        self.deleted.add(fp)
        if a is not None and a.state == AlertState.PENDING:
            self._transitions.append(Transition(a, AlertState.PENDING, AlertState.RESOLVED))
