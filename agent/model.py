"""Core types shared by every layer: samples, tensor statistics, findings and alerts.

They are plain frozen dataclasses (not pydantic models) because millions of samples flow
through the hot path; validation belongs to config and rule files, not to data.
"""

from __future__ import annotations

import enum
import functools
import gc
import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Mapping

# Metric names a parser may emit. Keeping them in one place stops near-duplicates
# ("gnorm", "grad_norm", "gradnorm") from spreading through detectors and exporters.
LOSS = "loss"                  # training loss
EVAL_LOSS = "eval_loss"        # validation/eval loss, kept apart from training loss
GRAD_NORM = "grad_norm"
LOSS_SCALE = "loss_scale"
LEARNING_RATE = "lr"
OVERFLOW = "overflow"          # one overflow/skipped-step event (value 1)
SKIPPED_INTERVAL = "skipped_in_interval"  # skipped steps counted over one log interval (Megatron)
SKIPPED_CUMULATIVE = "skipped_cumulative"  # running skip counter printed by the trainer (DeepSpeed)
DUMP_NONFINITE = "dump_nonfinite"  # a scanned dump whose first bad op was found (attrs: op, tensor, ...)
DUMP_OVERFLOW = "dump_overflow"  # one overflow record of an Opdebug file (attrs: op, accelerator, status, ...)
DUMP_FP16_SATURATED = "dump_fp16_saturated"  # fp16 values at ±65504 in one op's dumped outputs
DUMP_DIVERGENCE = "dump_divergence"  # a comparison with the benchmark run diverged (attrs: op, verdict, ...)
DUMP_NONDETERMINISM = "dump_nondeterminism"  # a rerun's dumps differ bitwise (attrs as dump_divergence)
DUMP_STEP = "dump_step"  # one per (step, rank) of a scanned dump: attrs step, nonfinite, overflow (dumps/samples.py)
DUMP_TENSOR = "dump_tensor"    # one watched tensor's statistics (dumps/watchpoints.py)
NONFINITE_MESSAGE = "nonfinite_message"  # an explicit trainer message that loss became NaN/Inf
# Run-wide facts a log states once (agent/readers/parsers/hints.py); they apply to every series of
# the file's run, whatever rank printed them
PRECISION = "precision"        # the run's precision as the log states it (attrs: mode, scaler, source)
TRAINING_END = "training_end"  # the trainer announced the normal end of training (attrs: marker)
HINT_METRICS = frozenset({PRECISION, TRAINING_END})
# The reader's own health (agent/readers/yields.py): judged by rules, kept in no training series
LOG_UNRECOGNIZED = "log_unrecognized"  # a followed file grows but yields no record (1), or records again (0)
READER_METRICS = frozenset({LOG_UNRECOGNIZED})
# Faults of the host's devices (agent/readers/parsers/kernel.py): judged by rules, kept in no training series
HW_FAULT = "hw_fault"          # one driver fault in the kernel log (attrs: device, code, class, meaning, ...)
HOST_METRICS = frozenset({HW_FAULT})
# The job's own verdict on a rejected result (agent/readers/parsers/megatron_rerun.py): read by the
# suspect verdict (agent/engine/suspect.py), kept in no training series
RERUN_VERDICT = "rerun_verdict"  # attrs: verdict (detected | transient | reproducible_same_gpu | ...), rank, ...
JOB_VERDICT_METRICS = frozenset({RERUN_VERDICT})
UNSERIED_METRICS = READER_METRICS | HOST_METRICS | JOB_VERDICT_METRICS  # judged without keeping a series

TRAINING_METRICS = (LOSS, EVAL_LOSS, GRAD_NORM, LOSS_SCALE, LEARNING_RATE)

Labels = tuple[tuple[str, str], ...]

SEVERITIES = ("info", "warning", "ticket", "page", "critical")   # of rules and findings, lowest first

# Rank copies of one message (every rank prints the same overflow line) carry log times this close;
# records further apart are separate events, even when they look the same.
DUP_WINDOW_S = 0.5


def far_apart(a: float | None, b: float | None) -> bool:
    """Two log times that belong to separate events (both known, further apart than DUP_WINDOW_S)."""
    return a is not None and b is not None and abs(a - b) > DUP_WINDOW_S


def make_labels(mapping: Mapping[str, str] | None = None, **extra: str) -> Labels:
    """Return a canonical (sorted, hashable) label tuple."""
    merged: dict[str, str] = dict(mapping or {})
    merged.update(extra)
    return tuple(sorted((str(k), str(v)) for k, v in merged.items() if v is not None and v != ""))


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold the cyclic garbage collector while a batch of samples is made or judged (the reader,
    agent/readers/logstream.py; the pipeline, agent/engine/pipeline.py).

    Both create objects per line that live on (records, samples, detector windows) and none that
    form reference cycles, so each collection the allocations trigger (one per 700) finds
    nothing to free, yet walks every young object: more than a third of the reader's time on a
    backlog. Reference counting still frees everything as usual; collection resumes after the
    batch (only if it was enabled: whoever disabled it keeps it disabled)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True, slots=True)
class SourcePos:
    """Where a sample came from, so every finding can point at the exact line."""

    path: str
    line: int          # 1-based line number inside the current file generation
    offset: int = -1   # byte offset of the line start, -1 if unknown


class SourcePosDraft:
    """``SourcePos``'s slots without its frozen ``__setattr__``: see ``source_pos`` (which the
    reader's per-record loop does inline)."""

    __slots__ = ("path", "line", "offset")


def source_pos(path: str, line: int, offset: int = -1) -> SourcePos:
    """``SourcePos(path, line, offset)`` at a third of the cost, for the reader's per-record
    loop: a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``.
    The fields are set on a draft with the same slot layout, which then becomes a
    ``SourcePos`` (same type, equality, hash and immutability as one built the usual way)."""
    p = SourcePosDraft()
    p.path, p.line, p.offset = path, line, offset
    p.__class__ = SourcePos  # type: ignore[assignment]
    return p  # type: ignore[return-value]


@dataclass(slots=True)  # not frozen: frozen dataclasses are slow to build, and samples are many
class Sample:
    """One value read from a training log.

    ``attrs`` carries event details a detector may need (e.g. the scale before and after
    an overflow back-off) without widening the type for every producer.
    """

    labels: Labels
    metric: str
    value: float
    step: int | None
    source: SourcePos
    time: float = 0.0            # ingestion wall-clock time (seconds since epoch)
    log_time: float | None = None  # timestamp printed on the line, if any
    attrs: tuple[tuple[str, Any], ...] = ()
    producer: str = ""           # the parser that read it (a log format name); "" when not from a log

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default


@dataclass(frozen=True, slots=True)
class TensorStats:
    """Statistics of one dumped tensor, from one blocked pass (agent/dumps/scanner.py) or as the
    dump gives them. Fields added later default to None, so an older serialised form loads."""

    name: str                 # op or module name
    io: str                   # "input" | "output" | "param" | ""
    index: int
    dtype: str
    shape: tuple[int, ...]
    count: int
    nan: int = 0
    pos_inf: int = 0
    neg_inf: int = 0
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    l2norm: float | None = None
    # mean(|x|) over the finite elements (MindInsight's watchpoints are stated on it); None for
    # producers that lack it (msprobe statistics mode, statistic.csv) and for older stored results
    abs_mean: float | None = None
    zero_fraction: float | None = None
    fp16_saturated: int = 0
    step: int | None = None
    rank: int | None = None
    path: str = ""

    @property
    def nonfinite(self) -> int:
        return self.nan + self.pos_inf + self.neg_inf


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    TICKET = "ticket"
    PAGE = "page"
    CRITICAL = "critical"


@dataclass(frozen=True, slots=True)
class Finding:
    """A detector's statement that a rule's condition holds for one series, with evidence."""

    rule: str             # the alert name of the rule that produced it
    kind: str             # rule kind, e.g. "nonfinite", "loss_scale"
    severity: str
    labels: Labels        # series labels plus the rule's own labels
    summary: str
    time: float
    step: int | None = None
    source: SourcePos | None = None
    value: float | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["labels"] = dict(self.labels)
        out["evidence"] = dict(self.evidence)
        out["annotations"] = dict(self.annotations)
        return out


class AlertState(str, enum.Enum):
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


def json_safe(obj: Any) -> Any:
    """JSON has no NaN/Inf: render them as "NaN", "+Inf", "-Inf", as Prometheus' API does."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return "NaN" if obj != obj else ("+Inf" if obj > 0 else "-Inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


@functools.lru_cache(maxsize=8192)  # asked for every hit and clear; the same few alerts again and again
def fingerprint(rule: str, labels: Labels) -> str:
    """Stable identity of an alert: the rule name plus its full label set."""
    import hashlib   # here: the one-shot commands never fingerprint, and its import is ~5 ms of theirs
    raw = json.dumps([rule, list(labels)], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


@dataclass(slots=True)
class Alert:
    """An alert's lifecycle record; persisted so a restart neither loses nor re-pages it."""

    fingerprint: str
    rule: str
    labels: Labels
    state: AlertState
    active_at: float
    last_seen: float
    fired_at: float | None = None
    resolved_at: float | None = None
    annotations: dict[str, str] = field(default_factory=dict)
    finding: dict[str, Any] = field(default_factory=dict)
    count: int = 1               # how many findings fed this alert

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "alertname": self.rule,
            "labels": dict(self.labels),
            "state": self.state.value,
            "activeAt": self.active_at,
            "lastSeen": self.last_seen,
            "firedAt": self.fired_at,
            "resolvedAt": self.resolved_at,
            "annotations": dict(self.annotations),
            "evidence": self.finding,
            "count": self.count,
        }
