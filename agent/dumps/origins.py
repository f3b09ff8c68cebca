"""The dump side's part of a non-finite incident's origin: per rank, its first non-finite dump.

For every (dump watch labels, ``rank``) the agent keeps the dump with the lowest step whose scan
found a NaN/Inf, and its first bad op (the op whose inputs were finite and an output was not,
``first_nonfinite`` of agent/dumps/scan.py). exporters/dumps.py exports it as

    precision_agent_dump_first_nonfinite_step{<watch labels>, rank, op}
    precision_agent_dump_first_nonfinite_timestamp_seconds{<watch labels>, rank, op}

one series per rank: a lower step replaces the op, so the op label never accumulates values.
The time is when the dump was written (its directory's newest modification time). The shipped
Prometheus rule ``TrainingNonFiniteOrigin`` (exporters/prometheus/alerts.yml) names the origin
rank's ``op`` in its summary and description.

A rank's record belongs to one attempt of the job, as the logs' first non-finite step does: a dump
of the same rank at the same or a lower step, written after the recorded one, is a rerun (a
restart from a checkpoint); if it is clean the record is dropped, if not it replaces the record.
A re-scan of the recorded directory itself replaces or drops it likewise. A later step's dump
never does: NaN spreads forward. The records survive an agent restart: the daemon saves them
in its state store whenever one changes (``rows``) and takes them back at start (``restore``),
since directories already scanned are not scanned again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..model import Labels, make_labels

MAX_RANKS = 512


@dataclass(frozen=True, slots=True)
class FirstBadDump:
    step: int | None
    when: float        # when the dump was written, seconds since the epoch
    op: str
    unit: str          # the scanned directory


def _clean_ranks(result: dict[str, Any]) -> dict[Any, int | None]:
    """rank -> lowest step, for each rank of a scan result none of whose tensors holds NaN/Inf."""
    out: dict[Any, int | None] = {}
    bad: set[Any] = set()
    for t in result.get("tensors") or ():
        r, s = t.get("rank"), t.get("step")
        if t.get("nan") or t.get("pos_inf") or t.get("neg_inf"):
            bad.add(r)
        if r not in out or (s is not None and (out[r] is None or s < out[r])):
            out[r] = s
    return {r: s for r, s in out.items() if r not in bad}


def _not_after(step: int | None, than: int | None) -> bool:
    return step is None or than is None or step <= than


class DumpOrigins:
    """The first non-finite dump of each rank, fed by the daemon's worker after each scan."""

    def __init__(self, cap: int = MAX_RANKS) -> None:
        self._lock = threading.Lock()
        self._cap = cap
        self._first: OrderedDict[Labels, FirstBadDump] = OrderedDict()
        self.version = 0   # bumped by every change of the records

    @staticmethod
    def key(labels: dict[str, str], rank: Any) -> Labels:
        return make_labels(labels, rank=str(rank)) if rank is not None else make_labels(labels)

    def observe(self, result: dict[str, Any], labels: dict[str, str], unit: str, when: float) -> bool:
        """One scan ``result`` of directory ``unit`` (written at ``when``) under a watch's ``labels``."""
        first = result.get("first_nonfinite")
        bad_rank = first.get("rank") if first else None
        with self._lock:
            before = self.version
            for rank, step in _clean_ranks(result).items():
                key = self.key(labels, rank)
                old = self._first.get(key)
                if old is not None and (old.unit == unit or (when > old.when and _not_after(step, old.step))):
                    del self._first[key]      # a clean rerun of that step or an earlier one
                    self.version += 1
            if first is None:
                return self._bump(before)
            key = self.key(labels, bad_rank)
            new = FirstBadDump(first.get("step"), when, str(first.get("op") or ""), unit)
            old = self._first.get(key)
            if (old is None or old.unit == unit or (when > old.when and _not_after(new.step, old.step))
                    or (new.step is not None and old.step is not None and new.step < old.step)
                    or (new.step == old.step and when < old.when)):
                self._first[key] = new
                self._first.move_to_end(key)
                while len(self._first) > self._cap:
                    self._first.popitem(last=False)
                self.version += 1
            return self._bump(before)

    def _bump(self, before: int) -> bool:
        """True when this observation changed the records (they are saved again then)."""
        return self.version != before

    def snapshot(self) -> list[tuple[Labels, FirstBadDump]]:
        with self._lock:
            return list(self._first.items())

    def rows(self) -> list[list[Any]]:
        """The records as plain JSON rows: [labels, step, when, op, unit], oldest first."""
        with self._lock:
            return [[[list(p) for p in k], f.step, f.when, f.op, f.unit] for k, f in self._first.items()]

    def restore(self, rows: list[Any]) -> int:
        """Take back ``rows()`` after a restart; returns how many rows were unreadable (skipped)."""
        bad = 0
        with self._lock:
            for row in rows[-self._cap:] if isinstance(rows, list) else ():
                try:
                    raw, step, when, op, unit = row
                    labels = tuple((str(k), str(v)) for k, v in raw)
                    if (step is not None and type(step) is not int) or not isinstance(when, (int, float)):
                        raise ValueError(row)
                    self._first[labels] = FirstBadDump(step, float(when), str(op), str(unit))
                except (TypeError, ValueError):
                    bad += 1
        return bad
