"""The detectors' memory between a state commit and the next: which rules are in force (a rule
rebuilt by a reload but unchanged keeps its detector and its memory), which rows changed, and
putting the rows of the last run back at start. The rows go to the SQLite store (state.py) in
the same transaction as offsets and alerts; the values' codec is memory.py."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from ..detectors.base import Detector, explicit, slots_of
from ..engine.rulefile import Rule
from ..model import Labels
from .memory import (WHOLE, CodecError, decode, decode_record, digest, dump_key, dumps, encode, encode_record, load_key,
                     loads, rule_keys)


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
        self.bad_rows: list[tuple[tuple[str, str, str, str, str, int], str]] = []  # (row, why): to quarantine
        self.unreadable: list[Rule] = []  # rules whose stored memory did not decode (they start empty)
        self.extra: dict[str, tuple[Getter, Restorer]] = {}  # non-rule memory (the alert book's)
        self._prune = True            # next commit: delete rows of removed or edited rules
        self._full = False            # next commit: rewrite everything (after a failed commit)
        self._clear_rules: set[str] = set()
        self._failed: set[str] = set()
        self._seq = 0
        # hash of the row last written per (rule, slot, series key): a detector that touches its
        # memory without changing it (stalled's tick, every evaluation interval) writes nothing,
        # so an idle agent does not commit (and fsync) every few seconds. Keyed by the series' own
        # labels tuple (the detector's key, shared), not a row key made for it: one entry per
        # series and slot is kept for every followed file
        self._written: dict[tuple[str, str], dict[Labels, int]] = {}

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
            self._written = {w: h for w, h in self._written.items() if w[0] not in self._clear_rules}
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
                written = self._written[(key, slot)] = {}
                keys: Iterable[Labels] = [k for k, _ in ps.items()]
            else:
                written = self._written.setdefault((key, slot), {})
                for k in ps.removed:
                    written.pop(k, None)
                    out.deletes.append((key, slot, dump_key(k)))
                keys = ps.changed if 4 * len(ps.changed) < len(ps) else \
                    [k for k, _ in ps.items() if k in ps.changed]  # LRU order, cheaply
            for k in keys:
                v = ps.value(k)
                if v is not None:
                    data = dumps(encode_record(ps.factory, v))
                    h = hash(data)
                    if not force and written.get(k) == h:
                        continue  # touched, not changed
                    written[k] = h
                    out.upserts.append((key, slot, dump_key(k), dig, data, self._next()))
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
        ignored (the first commit deletes them); a rule whose rows carry another digest starts
        empty, and is returned (its meaning changed). A rule one of whose rows does not decode
        starts empty too, but is listed in ``unreadable`` instead, and the row in ``bad_rows``
        (the store quarantines it): its alerts are kept (engine/alerts.py ``memory_lost``)."""
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
                except _BAD as exc:
                    self.bad_rows.append((rs[-1], f"{type(exc).__name__}: {str(exc)[:200]}"))
                continue
            if key not in by_key:
                continue
            rule, dig = by_key[key]
            if any(r[3] != dig for r in rs):
                dropped.append(rule)  # edited between runs: its old memory means something else
                continue
            bad = self._restore(rule.detector, rs)
            if bad is not None:
                fresh = type(rule.detector)(rule.detector.params)
                vars(rule.detector).clear()
                vars(rule.detector).update(vars(fresh))
                self._clear_rules.add(key)
                self.unreadable.append(rule)
                self.bad_rows.append(bad)
        return dropped

    @staticmethod
    def _restore(det: Detector, rows: list[tuple[str, str, str, str, str, int]]
                 ) -> tuple[tuple[str, str, str, str, str, int], str] | None:
        """Restore ``rows``; the first row that does not decode and why, or None."""
        slots = slots_of(det)
        for row in rows:
            _, slot, raw_key, _, data, _ = row
            try:
                if slot == WHOLE:
                    if not explicit(det):
                        raise CodecError("whole-detector memory for a kind without state()")
                    det.restore(decode(loads(data)))
                    continue
                ps = slots.get(slot)
                if ps is None:
                    raise CodecError(f"unknown memory slot {slot!r}")
                ps.restore(load_key(raw_key), decode_record(ps.factory, loads(data)))
            except _BAD as exc:
                return row, f"{type(exc).__name__}: {str(exc)[:200]}"
        return None


_BAD = (CodecError, ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, RecursionError)
