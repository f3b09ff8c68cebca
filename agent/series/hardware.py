"""The host's recent device faults and the jobs' rerun verdicts, kept for the suspect verdict.

One agent runs per host, so every ``hw_fault`` sample its pipeline sees (the ``kernel`` log format,
agent/readers/parsers/kernel.py) is a fault of this host's devices: the ledger keeps the latest
``MAX_FAULTS`` of them, and the latest ``MAX_RERUNS`` Megatron rerun verdicts (``rerun_verdict``,
agent/readers/parsers/megatron_rerun.py), each with the labels of the file it came from (its run).

Every note has two clocks: ``read`` (when the agent read it) and ``log_time`` (the stamp printed on
its line, when there is one; the ``as if UTC`` reading of the parsers). agent/engine/suspect.py
compares read times: a live agent reads a fault and a training line within seconds of their writing.
A line whose stamp is far older than its reading (``Note.stale``) is backlog, never a fault of now.
The notes are kept with the detectors' memory (the pipeline registers ``rows``/``restore``): a
restart between a fault and the incident it explains keeps the fault.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

from ..model import HW_FAULT, RERUN_VERDICT, Labels, Sample

MAX_FAULTS = 256
MAX_COUNTED = 1024  # (device, code, class) counters kept; further ones count as device/code "other"
MAX_RERUNS = 256
# A line stamp read this much older than its read time is stale for read-time comparisons, whatever
# the time zone the stamp was printed in (offsets go up to 14 h): a kernel log read from its start
# by a new agent, not a fault of the incident being judged now.
STALE_S = 15 * 3600.0
# ... and this much for a stamp that is exact (an offset on the line, or an epoch: ``time_basis`` of
# the kernel parsers, agent/readers/parsers/kernel_time.py): no zone doubt to allow for
EXACT_STALE_S = 3600.0
# ("uptime": a raw dmesg / kmsg stamp, seconds since boot, given a wall time by ``_since_boot``)
EXACT_BASES = frozenset({"offset", "epoch", "uptime"})
RUN_LESS = frozenset({"rank", "metric", "incident", "device", "code", "severity", "suspect"})


@dataclass(frozen=True, slots=True)
class Note:
    kind: str                      # "fault" | "rerun"
    read: float                    # when the agent read it
    log_time: float | None         # its line's own stamp
    step: int | None               # a rerun's iteration
    labels: Labels                 # its file's labels (a run's, for a rerun)
    attrs: tuple[tuple[str, Any], ...]
    where: str                     # "path:line"

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def stale(self) -> bool:
        """Read long after its own stamp says it was written (older than any time zone explains)."""
        if self.log_time is None:
            return False
        limit = EXACT_STALE_S if self.attr("time_basis") in EXACT_BASES else STALE_S
        return self.read - self.log_time > limit

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.attrs if isinstance(v, (str, int, float, bool))}
        out["read_at"] = self.read
        if self.log_time is not None:
            out["log_time"] = self.log_time
        if self.step is not None:
            out["iteration"] = self.step
        out["at"] = self.where
        return out


def _since_boot(uptime: object, read: float) -> float | None:
    """The wall time of a line stamped ``uptime`` seconds after boot (raw dmesg, /dev/kmsg), read at
    ``read``: this host's boot, by its /proc/uptime now. A stamp later than the host's uptime is of
    a boot before this one: 0.0, as old as can be (stale). None where nothing is known."""
    if not isinstance(uptime, (int, float)) or isinstance(uptime, bool) or not 0 <= uptime < 1e10:
        return None
    try:
        with open("/proc/uptime", "rb") as f:
            now_up = float(f.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if uptime > now_up + 1.0:
        return 0.0
    return read - (now_up - uptime)


def run_labels(labels: Labels) -> Labels:
    """The labels that name a run (a file's labels less rank and the per-alert ones)."""
    return tuple(kv for kv in labels if kv[0] not in RUN_LESS)


class HostLedger:
    """Bounded memory of this host's device faults and the jobs' rerun verdicts."""

    def __init__(self) -> None:
        self.faults: deque[Note] = deque(maxlen=MAX_FAULTS)
        self.reruns: deque[Note] = deque(maxlen=MAX_RERUNS)
        # every fault read, by (device, code, class): precision_agent_hardware_faults_total
        self.counts: dict[tuple[str, str, str], int] = {}
        self._changed = False  # a note kept since the last ``rows``

    def note(self, sample: Sample) -> None:
        """Keep a ``hw_fault`` or ``rerun_verdict`` sample (others are ignored)."""
        if sample.metric == HW_FAULT:
            into, kind = self.faults, "fault"
        elif sample.metric == RERUN_VERDICT:
            into, kind = self.reruns, "rerun"
        else:
            return
        src = sample.source
        where = f"{src.path}:{src.line}" if src is not None else ""
        log_time = sample.log_time
        if log_time is None and kind == "fault":
            log_time = _since_boot(sample.attr("uptime"), sample.time)
        note = Note(kind, sample.time, log_time, sample.step, run_labels(sample.labels), sample.attrs, where)
        if kind == "fault" and not note.stale:  # backlog (an old line read now) is not counted
            key = (str(sample.attr("device", "")), str(sample.attr("code", "")), str(sample.attr("class", "unknown")))
            if key not in self.counts and len(self.counts) >= MAX_COUNTED:
                key = ("other", "other", key[2])
            self.counts[key] = self.counts.get(key, 0) + 1
        if kind == "rerun" and any(_same_rerun(note, o) for o in self.reruns):
            return  # the pair of lines of one outcome ("First rerun: ..." then "Possible transient error!")
        into.append(note)
        self._changed = True

    # -- kept with the detectors' memory (store/book.py ``extra``), so a restart keeps what was read --
    def rows(self, full: bool) -> list | None:
        """The notes as plain data; None when nothing changed since the last call (unless ``full``)."""
        if not (full or self._changed):
            return None
        self._changed = False
        return [[n.kind, n.read, n.log_time, n.step, [list(kv) for kv in n.labels],
                 [[k, v] for k, v in n.attrs if v is None or isinstance(v, (str, int, float, bool))], n.where]
                for n in (*self.faults, *self.reruns)]

    def restore(self, data: object) -> None:
        """Put back what ``rows`` gave; raises ValueError on anything else (the row is set aside)."""
        if not isinstance(data, list):
            raise ValueError("expected a list of notes")
        notes = [_note(row) for row in data]
        self.faults.extend(n for n in notes if n.kind == "fault")
        self.reruns.extend(n for n in notes if n.kind == "rerun")

    def faults_between(self, start: float, end: float) -> Iterator[Note]:
        """Faults read within [start, end], less the stale ones."""
        for f in self.faults:
            if start <= f.read <= end and not f.stale:
                yield f

    def reruns_of(self, labels: Labels) -> Iterator[Note]:
        """Rerun verdicts of the run an alert's labels name (every label of the verdict's file is one
        of the alert's: the same file set, whatever labels the alert adds)."""
        have = set(labels)
        for r in self.reruns:
            if all(kv in have for kv in r.labels):
                yield r


def _note(row: object) -> Note:
    if not isinstance(row, list) or len(row) != 7:
        raise ValueError("a note is a list of 7")
    kind, read, log_time, step, labels, attrs, where = row
    ok = (kind in ("fault", "rerun") and type(read) in (int, float) and (log_time is None or type(log_time) in (int, float))
          and (step is None or type(step) is int) and isinstance(where, str)
          and isinstance(labels, list) and all(isinstance(kv, list) and len(kv) == 2 and all(isinstance(x, str) for x in kv)
                                                for kv in labels)
          and isinstance(attrs, list) and all(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str)
                                               for kv in attrs))
    if not ok:
        raise ValueError(f"not a note: {str(row)[:200]}")
    return Note(kind, float(read), log_time, step, tuple((k, v) for k, v in labels),
                tuple((k, v) for k, v in attrs), where)


def _same_rerun(a: Note, b: Note) -> bool:
    return (a.labels == b.labels and a.step == b.step and a.attr("verdict") == b.attr("verdict")
            and a.attr("rank") == b.attr("rank"))
