"""Per-series state: the loss-scale trajectory, logical overflow steps and last values.

A *series* is one training stream (one label set: job, run, rank, ...). This is where the raw
records that parsers read become *logical* facts:

* Several ranks (or log handlers) print the same overflow message; only the first copy counts.
  Copies are recognised by content (the same scale transition, the same step), with no training
  progress in between and, where lines carry timestamps, less than ``DUP_WINDOW_S`` apart.
* A decrease is counted between consecutive observed scale values, so several halvings hidden
  in one Megatron log interval count as one observed decrease (what the log can prove).
* Trainers that print a skip counter (Megatron per interval, DeepSpeed cumulative) add only the
  skips that no overflow message accounted for, so nothing is counted twice.

The daemon and ``replay`` share this code; the state is JSON-serialisable so it survives restarts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .model import (LOSS, LOSS_SCALE, NONFINITE_MESSAGE, OVERFLOW, SKIPPED_CUMULATIVE, SKIPPED_INTERVAL,
                    Labels, Sample)

DUP_WINDOW_S = 0.5
_PERSISTED = ("records", "first_step", "last_step", "last_update", "last", "scale_first", "scale_min",
              "scale_last", "scale_decreases", "scale_increases", "overflow_steps", "nonfinite")


@dataclass
class SeriesState:
    labels: Labels
    records: int = 0
    first_step: int | None = None
    last_step: int | None = None
    last_update: float = 0.0
    last: dict[str, float] = field(default_factory=dict)
    scale_first: float | None = None
    scale_min: float | None = None
    scale_last: float | None = None
    scale_decreases: int = 0
    scale_increases: int = 0
    overflow_steps: int = 0
    nonfinite: dict[str, int] = field(default_factory=dict)
    # dedup and reconciliation context (persisted with ``to_dict(context=True)``, so that a copy of
    # an overflow message or a skip counter read just after a restart counts as without one)
    _last_transition: tuple[float | None, float | None, float | None] | None = None  # (from, to, log_time)
    _progress_since_transition: bool = True
    _last_overflow: dict[str, Any] | None = None
    _progress_since_overflow: bool = True
    _events_since_counter: int = 0
    _last_cumulative: float | None = None
    _progress_step: int | None = None

    # -- ingestion -------------------------------------------------------------------------
    def ingest(self, s: Sample) -> list[Sample]:
        """Update the state with one sample; return the samples detectors should judge.

        Duplicates return []; a skip counter returns the overflow steps it adds, if any.
        """
        self.records += 1
        self.last_update = max(self.last_update, s.time)
        m = s.metric
        if s.step is not None:
            if self.last_step is None or s.step > self.last_step:
                self.last_step = s.step
            if self.first_step is None or s.step < self.first_step:
                self.first_step = s.step
            # Overflow messages name the step they failed on; only other records show progress.
            if (m != OVERFLOW and s.attr("frm") is None
                    and (self._progress_step is None or s.step > self._progress_step)):
                self._progress_step = s.step
                self._progress()
        if m == LOSS_SCALE:
            return [s] if self._scale(s) else []
        if m == OVERFLOW:
            if self._duplicate_overflow(s):
                return []
            self.overflow_steps += 1
            self._events_since_counter += 1
            return [s]
        if m == SKIPPED_INTERVAL:
            return self._reconcile(s, int(s.value))
        if m == SKIPPED_CUMULATIVE:
            prev, self._last_cumulative = self._last_cumulative, s.value
            if prev is None or s.value < prev:  # first reading, or the trainer restarted
                self._events_since_counter = 0
                return []
            return self._reconcile(s, int(s.value - prev))
        if m == LOSS:
            self._progress()
        if m != NONFINITE_MESSAGE:
            self.last[m] = s.value
        if m == NONFINITE_MESSAGE or not math.isfinite(s.value):
            self.nonfinite[m] = self.nonfinite.get(m, 0) + 1
        return [s]

    def _progress(self) -> None:
        self._progress_since_transition = True
        self._progress_since_overflow = True

    def _reconcile(self, s: Sample, skipped: int) -> list[Sample]:
        extra = max(0, skipped - self._events_since_counter)
        self._events_since_counter = 0
        if extra == 0:
            return []
        self.overflow_steps += extra
        return [Sample(s.labels, OVERFLOW, float(extra), s.step, s.source, s.time, s.log_time,
                       (("variant", "counter"),))]

    def _scale(self, s: Sample) -> bool:
        frm = s.attr("frm")
        if frm is not None:
            lt = self._last_transition
            if (lt is not None and not self._progress_since_transition and lt[0] == frm and lt[1] == s.value
                    and self.scale_last == s.value and not far_apart(lt[2], s.log_time)):
                return False  # another rank's copy of the transition just seen
            self._last_transition = (frm, s.value, s.log_time)
            self._progress_since_transition = False
            self._observe_scale(frm)
        elif s.attr("decrease") and self.scale_last is None:
            # "reducing loss scale to X" with no earlier value seen: the message itself
            # proves a decrease happened (apex, fairseq, torch_npu print only the new value)
            self.scale_decreases += 1
        self._observe_scale(s.value)
        self.last[LOSS_SCALE] = s.value
        return True

    def _observe_scale(self, v: float) -> None:
        if self.scale_first is None:
            self.scale_first = v
        if self.scale_last is not None:
            if v < self.scale_last:
                self.scale_decreases += 1
            elif v > self.scale_last:
                self.scale_increases += 1
        self.scale_min = v if self.scale_min is None else min(self.scale_min, v)
        self.scale_last = v

    def _duplicate_overflow(self, s: Sample) -> bool:
        cur = {"step": s.step, "frm": s.attr("frm"), "to": s.attr("to"), "variant": s.attr("variant"),
               "log_time": s.log_time}
        prev, self._last_overflow = self._last_overflow, cur
        fresh, self._progress_since_overflow = self._progress_since_overflow, False
        if prev is None or fresh or far_apart(prev["log_time"], s.log_time):
            return False
        for key in ("step", "frm", "to", "variant"):
            if prev[key] is not None and cur[key] is not None and prev[key] != cur[key]:
                return False
        # merge what the copies know (e.g. the step from "Grad overflow on iteration N")
        self._last_overflow = {k: cur[k] if cur[k] is not None else prev[k] for k in cur}
        return True

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self, context: bool = False) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _PERSISTED}
        if context:
            out["context"] = {k: getattr(self, "_" + k) for k in _CONTEXT}
        return out

    @classmethod
    def from_dict(cls, labels: Labels, data: dict[str, Any]) -> "SeriesState":
        """Rebuild a stored series; a malformed context raises ValueError (the row is skipped)."""
        st = cls(labels)
        for k in _PERSISTED:
            if k in data:
                setattr(st, k, data[k])
        ctx = data.get("context")
        if ctx is not None:
            if not isinstance(ctx, dict):
                raise ValueError("series context is not an object")
            for k, check in _CONTEXT.items():
                if k in ctx:
                    v = ctx[k]
                    if not check(v):
                        raise ValueError(f"series context {k}: unexpected {v!r:.80}")
                    setattr(st, "_" + k, tuple(v) if k == "last_transition" and v is not None else v)
        return st


def _num(v: Any) -> bool:
    return v is None or (type(v) in (int, float))


_CONTEXT: dict[str, Any] = {  # field (without its underscore) -> type check of its stored value
    "last_transition": lambda v: v is None or (isinstance(v, list) and len(v) == 3 and all(map(_num, v))),
    "progress_since_transition": lambda v: type(v) is bool,
    "last_overflow": lambda v: v is None or (isinstance(v, dict) and set(v) == {"step", "frm", "to", "variant",
                                                                                 "log_time"}),
    "progress_since_overflow": lambda v: type(v) is bool,
    "events_since_counter": lambda v: type(v) is int,
    "last_cumulative": _num,
    "progress_step": lambda v: v is None or type(v) is int,
}


def far_apart(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) > DUP_WINDOW_S
