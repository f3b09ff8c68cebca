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
* A dynamic scaler backs off only after an overflow, so every back-off the scale values prove is
  an overflow event: ``overflow_steps >= scale_decreases`` always holds. Step-less skip messages
  (torch_npu's ``Gradient overflow. Skipping step``, printed by every rank) are held until the
  back-off message that follows them, or the next progress, so the copies of one event count once.
* A non-finite gradient norm with a finite loss, in a run that may use loss scaling, is what a
  scaler's skipped step looks like (HF Trainer + GradScaler): an overflow event.
* The run's precision and loss scaling (``loss_scaling``), from what the log states (hints) or
  how the scale behaves; the end-of-training marker (``finished``); and attempts: a progress
  step that goes back (a restart from a checkpoint, or a new run in the same file) starts a new
  attempt, whose scale trajectory starts afresh instead of recording an "increase".

The overflow accounting (scale values, skip counters, copies of messages) is in overflows.py.
The daemon and ``replay`` share this code; the state is JSON-serialisable so it survives restarts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..model import (GRAD_NORM, HINT_METRICS, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, OVERFLOW, PRECISION,
                    SKIPPED_CUMULATIVE, SKIPPED_INTERVAL, TRAINING_END, Labels, Sample)
from .overflows import APPLIED_GRAD_NORM_PRODUCERS, OverflowAccounting

# records read this long after an end-of-training marker mean training went on (the last lines of
# other ranks and handlers come right after it)
FINISHED_GRACE_S = 60.0
RESTART_RECORDS = 3  # progress records in a row behind the last step that make a new attempt
_PERSISTED = ("records", "first_step", "last_step", "last_update", "last", "scale_first", "scale_min",
              "scale_last", "scale_decreases", "scale_increases", "overflow_steps", "nonfinite",
              "precision", "scaler", "finished", "finished_at", "attempt", "scale_max", "scaler_events", "producer",
              "attempt_base", "restarting", "first_nonfinite_step", "first_nonfinite_time")

# producers whose trainers have no loss scaler at all (torchtitan trains in bf16/fp32 through FSDP's
# mixed precision)
NO_SCALER_PRODUCERS = frozenset({"torchtitan"})
# metrics whose values ``ingest`` does more with than keep the last (ingest_run's short way is
# for the others)
_VALUE_LOGIC = HINT_METRICS | {LOSS_SCALE, OVERFLOW, SKIPPED_INTERVAL, SKIPPED_CUMULATIVE, NONFINITE_MESSAGE}
_NO_RECORD = object()


@dataclass(slots=True)  # no __dict__: ~1 kB less per followed series
class SeriesState(OverflowAccounting):
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
    precision: str | None = None   # fp16 | bf16 | fp32, as the log states it (None: not stated)
    scaler: str | None = None      # dynamic | static, as the log states it
    finished: bool = False         # the trainer announced the normal end of training
    finished_at: float = 0.0       # when that announcement was read
    attempt: int = 1               # 2, 3, ...: the steps went back (restart, or a new run in the file)
    scale_max: float | None = None
    scaler_events: int = 0         # overflow events the scaler or trainer reported itself
    producer: str = ""             # the parser of the last training record
    # (decreases, increases, scaler events) when the current attempt began: what the run is
    # (dynamic_evidence) is judged on the current attempt alone
    attempt_base: tuple[int, int, int] | list = (0, 0, 0)
    # the first NaN/Inf of the current attempt that is no scaler's skipped step (a loss, a trainer's
    # message, or a grad norm where the run does not scale its loss): where an incident started
    first_nonfinite_step: int | None = None
    first_nonfinite_time: float | None = None  # the line's own time stamp where it has one
    gradnorm_explained: bool = False  # the last non-finite grad norm had a scaler event of its own
    # the run printed its start-up statements (precision) or its end again: the next step that
    # goes back, by however little, is a new attempt
    restarting: bool = False
    # dedup and reconciliation context (persisted with ``to_dict(context=True)``, so that a copy of
    # an overflow message or a skip counter read just after a restart counts as without one)
    _last_transition: tuple[float | None, float | None, float | None] | None = None  # (from, to, log_time)
    _progress_since_transition: bool = True
    _last_overflow: dict[str, Any] | None = None
    _progress_since_overflow: bool = True
    _events_since_counter: int = 0
    _last_cumulative: float | None = None
    _progress_step: int | None = None
    _progress_producer: str = ""
    _progress_epoch: int | None = None  # the epoch of producers whose steps count within it
    _step_delta: int = 0               # the last advance of the progress step
    _behind: int = 0                   # records in a row whose step fell behind (a restart?)
    _behind_line: tuple[str, int] | None = None
    _progress_since_scale: bool = False  # a progress record since the last scale value
    _pending_skip: bool = False        # a step-less skip message waits for its back-off message
    _overflows_since_scale: int = 0    # overflow events counted since the last scale value
    _window_overflows: int = 0         # overflow events counted since the last progress record
    _window_before: int = 0            # the same, for the window the last progress record closed
    _progress_line: tuple[str, int] | None = None  # the line of the last progress record

    # -- what the run is ---------------------------------------------------------------------------
    @property
    def dynamic_evidence(self) -> bool:
        """The scale moved, or the scaler/trainer reported overflows: dynamic loss scaling is on."""
        dec, inc, events = self.attempt_base
        if self.scale_decreases > dec or self.scale_increases > inc or self.scaler == "dynamic":
            return True
        # a bf16/fp32 trainer skips steps too (Megatron on a NaN gradient): no scaler in that
        return self.scaler_events > events and self.precision not in ("bf16", "fp32")

    @property
    def loss_scaling(self) -> str:
        """"yes", "no" or "unknown": whether this run scales its loss (docs/rules.md, "Precision
        mode"). A scale that never left 1.0, with no overflow or skip, is no loss scaling: that
        is what Megatron prints in bf16."""
        if self.dynamic_evidence or self.precision == "fp16" or self.scaler == "static":
            return "yes"
        if self.scale_max is not None and self.scale_max > 1.0:
            return "yes"
        if self.precision in ("bf16", "fp32") or self.producer in NO_SCALER_PRODUCERS:
            return "no"
        if self.scale_max is not None:  # every value seen was 1.0 (or below) and nothing moved
            return "no"
        return "unknown"

    def apply_hint(self, s: Sample) -> None:
        """A run-wide fact (precision, end of training) read on any line of the run's file."""
        if self._progress_step is not None:
            self.restarting = True
        if s.metric == PRECISION:
            mode, scaler = s.attr("mode"), s.attr("scaler")
            if mode in ("fp16", "bf16", "fp32"):
                self.precision = mode
            if scaler in ("dynamic", "static"):
                self.scaler = scaler
        elif s.metric == TRAINING_END:
            self.finished, self.finished_at = True, s.time
    # -- ingestion -------------------------------------------------------------------------
    def ingest(self, s: Sample) -> list[Sample] | tuple[Sample]:
        """Update the state with one sample; return the samples detectors should judge.

        Duplicates return []; a skip counter returns the overflow steps it adds, if any.
        """
        m = s.metric
        if m in HINT_METRICS:  # the pipeline hands these to every series of the run
            self.apply_hint(s)
            return []
        self.records += 1
        if s.time > self.last_update:
            self.last_update = s.time
        out: list[Sample] = []
        producer = s.producer
        if producer:
            self.producer = producer
        step = s.step
        progressed = False  # _progress ran for this sample (a second call would change nothing)
        if step is not None:
            attrs = s.attrs
            # Overflow messages name the step they failed on; only other records show progress.
            progress = m != OVERFLOW and (not attrs or s.attr("frm") is None)
            ps = self._progress_step
            if progress and ps is not None and step < ps and producer == self._progress_producer:
                ps = self._behind_step(s, step, ps)
            last_step = self.last_step
            if last_step is None or step > last_step:
                self.last_step = step
            first_step = self.first_step
            if first_step is None or step < first_step:
                self.first_step = step
            if progress and (ps is None or step > ps):
                if ps is not None:
                    self._step_delta = step - ps
                self._progress_step, self._progress_producer, self._behind = step, producer, 0
                self.restarting = False
                if attrs:
                    self._progress_epoch = s.attr("epoch", self._progress_epoch)
                self._progress(s, out)
                progressed = True
        if m == LOSS_SCALE:
            events: list[Sample] = []
            if self._scale(s, events):
                out.append(s)
            return out + events  # the overflow events a back-off proves come after the value
        if m == OVERFLOW:
            if s.attr("held") and s.step is None:
                # a step-less skip message: every rank prints one; the back-off message that
                # follows (or the next progress) says how many events they were
                self.scaler_events += 1
                self._pending_skip = True
                return out
            if self._duplicate_overflow(s):
                return out
            self.scaler_events += 1
            self._count(1)
            out.append(s)
            return out
        if m == SKIPPED_INTERVAL:
            return out + self._reconcile(s, int(s.value))
        if m == SKIPPED_CUMULATIVE:
            prev, self._last_cumulative = self._last_cumulative, s.value
            if prev is None or s.value < prev:  # first reading, or the trainer restarted
                self._events_since_counter = 0
                return out
            return out + self._reconcile(s, int(s.value - prev))
        if m == LOSS and not progressed:
            self._progress(s, out)
        value = s.value
        if m != NONFINITE_MESSAGE:
            self.last[m] = value
        if m == NONFINITE_MESSAGE or not math.isfinite(value):
            self.nonfinite[m] = self.nonfinite.get(m, 0) + 1
            if m == GRAD_NORM:
                self._gradnorm_overflow(s, out)
            if self.first_nonfinite_step is None and (m != GRAD_NORM or self.loss_scaling == "no"
                                                      or s.producer in APPLIED_GRAD_NORM_PRODUCERS):
                self.first_nonfinite_step = s.step if s.step is not None else self.last_step
                self.first_nonfinite_time = s.log_time if s.log_time is not None else s.time
        if not out:
            return (s,)  # the common case: the value itself, nothing the record proved besides
        out.append(s)
        return out

    def ingest_run(self, run: list[Sample], i: int, stop: int,
                   quiet: frozenset[str] | set[str]) -> tuple[int, list[Sample] | tuple[Sample, ...] | None]:
        """``ingest`` ``run[i:stop]`` in order, up to the first sample whose answer the pipeline
        must act on (more than the sample itself, a metric not in ``quiet``, a new attempt).
        Returns ``(k, accepted)``: ``run[i:k]`` answered only themselves, ``run[k]`` answered
        ``accepted``; ``(stop, None)`` when all did. This is ``ingest`` a sample after the other:
        a later value of the record just ingested (the same ``SourcePos`` object, step, time,
        producer, no attributes, the step in force) leaves the record-level fields as the first
        left them, so a finite float of a plain metric only counts and becomes the last value,
        and a scale equal to the last (inside the range seen) only resets what ``_scale`` does;
        all else goes through ``ingest`` (tests/series/test_ingest_run.py)."""
        ingest, last, attempt = self.ingest, self.last, self.attempt
        src: Any = _NO_RECORD  # the record of the last sample ingested in full, where in force
        step = t = prod = None
        short = 0  # samples that took the short way since ``records`` was last brought up to date
        while i < stop:
            s = run[i]
            if s.source is src and s.step == step and s.time == t and s.producer == prod and not s.attrs:
                m, v = s.metric, s.value
                if m not in _VALUE_LOGIC:
                    if v.__class__ is float and v - v == 0.0 and (
                            m != LOSS or self._progress_line == (src.path, src.line)):
                        short += 1  # ``ingest`` with nothing to do but count and keep the last value
                        last[m] = v
                        if m not in quiet:
                            self.records += short
                            return i, (s,)
                        i += 1
                        continue
                elif (m == LOSS_SCALE and v.__class__ is float and v == self.scale_last
                      and self.scale_first is not None and (low := self.scale_min) is not None and low <= v
                      and (high := self.scale_max) is not None and v <= high):
                    # ``_scale`` of the scale where it was: no back-off, no growth, nothing to note
                    short += 1
                    self.scale_last = last[m] = v
                    self._overflows_since_scale = 0
                    self._progress_since_scale = False
                    if m not in quiet:
                        self.records += short
                        return i, [s]
                    i += 1
                    continue
            if short:
                self.records += short
                short = 0
            out = ingest(s)
            m = s.metric
            step = s.step
            if m in HINT_METRICS or s.source is None or (step is not None and step != self._progress_step):
                src = _NO_RECORD  # (a step other than the progress step: the record part is no no-op)
            else:
                src, t, prod = s.source, s.time, s.producer
            if m not in quiet or self.attempt != attempt or len(out) != 1 or out[0] is not s:
                return i, out
            i += 1
        if short:
            self.records += short
        return stop, None

    def _behind_step(self, s: Sample, step: int, ps: int) -> int | None:
        """A progress record whose step is below the last one. A new epoch of a per-epoch counter
        is progress; a step far back (more than two advances) is a restart, and so is one that
        stays behind for ``RESTART_RECORDS`` records in a row; a record just behind is another
        rank or handler out of step. Returns the progress step in force after it."""
        epoch = s.attr("epoch") if s.attrs else None
        if epoch is not None and self._progress_epoch is not None and epoch > self._progress_epoch:
            return None  # the next epoch: its steps start again
        line = (s.source.path, s.source.line)
        if line != self._behind_line:  # once per record, not per value
            self._behind_line = line
            self._behind += 1
        if (self.restarting or ps - step >= 2 * max(self._step_delta, 1)
                or self._behind >= RESTART_RECORDS):
            self.new_attempt()
            return None
        return ps

    @property
    def attempt_step(self) -> int | None:
        """The step the current attempt reached (``last_step`` is the highest of every attempt)."""
        return self._progress_step if self._progress_step is not None else self.last_step

    def new_attempt(self) -> None:
        """The steps went back: a restart from a checkpoint or another run in the same file. The
        scale trajectory and the copy filters start afresh (totals and counters are kept)."""
        self.attempt += 1
        self.restarting = False
        self.first_nonfinite_step = self.first_nonfinite_time = None
        self.attempt_base = (self.scale_decreases, self.scale_increases, self.scaler_events)
        self.scale_last = self.scale_max = None
        self._progress_step = None
        self._behind = 0
        self.finished = False
        self._last_transition = None
        self._last_overflow = None
        self._progress_since_transition = self._progress_since_overflow = True
        self._events_since_counter = 0
        self._last_cumulative = None
        self._pending_skip = False
        self._overflows_since_scale = self._window_overflows = self._window_before = 0
        self._progress_line = None

    def _progress(self, s: Sample, out: list[Sample]) -> None:
        line = (s.source.path, s.source.line)
        if line == self._progress_line:
            return  # another value of the same record
        if self._pending_skip:  # skip messages that no back-off message followed: one event
            self._pending_skip = False
            self._count(1)
            out.append(self._event(s, 1, "skip"))
        self._progress_since_transition = True
        self._progress_since_overflow = True
        self._window_before, self._window_overflows = self._window_overflows, 0
        self._progress_line = line
        self._progress_since_scale = True
        if self.finished and s.time - self.finished_at > FINISHED_GRACE_S:
            self.finished = False  # training went on well after an announced end (another fit)

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
        base = st.attempt_base
        if not (isinstance(base, (list, tuple)) and len(base) == 3 and all(type(x) is int for x in base)):
            raise ValueError(f"series attempt_base: unexpected {base!r:.80}")
        st.attempt_base = tuple(base)
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
    "progress_producer": lambda v: type(v) is str,
    "progress_epoch": lambda v: v is None or type(v) is int,
    "step_delta": lambda v: type(v) is int,
    "behind": lambda v: type(v) is int,
    "progress_since_scale": lambda v: type(v) is bool,
    "pending_skip": lambda v: type(v) is bool,
    "overflows_since_scale": lambda v: type(v) is int,
    "window_overflows": lambda v: type(v) is int,
    "window_before": lambda v: type(v) is int,
}
