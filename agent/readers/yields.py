"""Never blind without saying so: followed files that grow but yield no record.

Every reader counts what it reads (*units*: lines of a text log, records of an event file) and
the training records it yields; the follower hands both totals to :class:`YieldWatch` after each
read. A file is *unrecognised* when it has grown since the agent first saw it, yet yielded no
record over ``limits.unrecognized_lines`` units, or for ``limits.unrecognized_after`` while still
growing steadily (``limits.unrecognized_min_lines`` units within the last half to whole window:
start-up output, then a long silent checkpoint load, is no blindness), whichever comes first.
Chatter (blank lines, progress-bar frames, NCCL debug lines) is no unit. A file that yielded records
and then *stopped* (the trainer was upgraded mid-run, its output changed) is judged the same
way, with thresholds no lower than four times the largest gap between records seen so far (an
evaluation phase that prints a lot is no stop).

Files of a run that is not blind raise nothing: when another file of the same run (its labels
less ``rank``: ``train.err`` beside ``train.log``, rank 1's log beside rank 0's) yields records
(it had some, and no verdict stands on it), this file is one that legitimately holds none
(warnings, progress bars, NCCL chatter, the other ranks' output).

The verdict is a sample of the reader-health metric ``log_unrecognized`` (value 1: blind,
evidence in ``attrs``; value 0: records again), labelled with the file's run labels and ``file``;
the ``unrecognized_log`` rule kind turns it into the alerts ``LogFormatUnrecognized`` and
``LogRecordsStopped`` (rules/readers.yml). While the condition holds the sample is sent again
(at most once a minute, only while the file grows), so the alert stays firing and resolves after
the rule's ``resolve_after`` once the file stops growing or is excluded; a deleted file's verdict
is withdrawn at once (``forget``). Another reader (event files, CSV) takes part by handing its
own units and records to ``update``, and a ``samples`` callable (or ``lambda: []``).

Not persisted: after a restart each file is judged afresh (a stop is then seen as
``unrecognized``, and the gaps between records are learnt again).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

from ..model import LOG_UNRECOGNIZED, Labels, Sample, SourcePos
from .parsers.base import strip_ansi

SAMPLE_LINES = 5          # sample lines kept per file for the alert's evidence
SAMPLE_LINE_CHARS = 200   # each cut to this many characters
RESEND_S = 60.0           # a blind file that still grows re-sends its verdict at most this often
STOP_GAP_FACTOR = 4       # a stop must last this many times the largest gap between records seen
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Lines that are never records and say nothing about the format: blank ones (also behind a
# docker-compose "service  | " prefix), progress-bar frames (tqdm, rich: "45%|###  | 45/100 [00:10<...",
# one per line in docker logs), NCCL's debug chatter. They do not count as units: an evaluation
# that draws thousands of frames between two records is no sign of blindness. Two plain scans,
# linear in the text whatever it holds (hostile lines of a megabyte included).
_BLANK_RE = re.compile(r"^(?:[\w.-]{1,64} +\| ?)?[ \t]*$", re.M)
_PROGRESS_RE = re.compile(r"%\||/\d{1,12} \[\d|NCCL (?:INFO|WARN)")


def chatter(text: str) -> int:
    """How many lines of ``text`` (complete lines, each ending in a newline) are chatter."""
    end = len(text) - 1
    if end < 0:
        return 0
    n = len(_BLANK_RE.findall(text, 0, end))
    pos, search, find = 0, _PROGRESS_RE.search, text.find
    while (m := search(text, pos, end)) is not None:  # one count per line, then on to the next line
        n += 1
        pos = find("\n", m.end()) + 1
        if pos <= 0:
            break
    return n


UNRECOGNIZED, STOPPED = "unrecognized", "stopped"


def clean_line(line: str) -> str:
    """A log line fit for an alert's evidence: ANSI and control characters out, bounded length."""
    line = _CONTROL_RE.sub("", strip_ansi(line[:4 * SAMPLE_LINE_CHARS]).replace("\t", " ")).strip()
    return line if len(line) <= SAMPLE_LINE_CHARS else line[:SAMPLE_LINE_CHARS - 1] + "…"


def _is_chatter(line: str) -> bool:
    return _BLANK_RE.match(line) is not None or _PROGRESS_RE.search(line) is not None


def tail_lines(text: str, keep: list[str]) -> None:
    """Put the last lines of ``text`` that are not chatter at the end of ``keep`` (at most
    SAMPLE_LINES), cleaned; only the last few dozen lines are looked at."""
    heads = (x[:4 * SAMPLE_LINE_CHARS] for x in text.rsplit("\n", 48)[-48:])  # long lines: their start
    lines = [c for x in heads if not _is_chatter(x) and (c := clean_line(x))]
    keep.extend(lines[-SAMPLE_LINES:])
    del keep[:-SAMPLE_LINES]


@dataclass(slots=True)
class _Track:
    run: Labels
    labels: Labels
    units: int = 0              # units read so far
    records: int = 0            # records yielded so far
    size0: int = -1             # the file's size when first seen (it must grow past it)
    grew: bool = False
    mark_units: int = 0         # units at the last record (or when first seen)
    mark_time: float | None = None  # when the current stretch without records began
    last_record: float | None = None  # when the file last yielded a record (None: never)
    max_gap_units: int = 0      # the largest stretch without records, between two records
    max_gap_s: float = 0.0
    alerted: str | None = None  # UNRECOGNIZED | STOPPED while the verdict stands
    sent: float = 0.0           # when the verdict was last sent
    # the recent growth, in two half windows of ``after``: units at the start of the current one
    # (``win_units``, begun at ``win_time``) and of the one before (``prev_units``)
    win_time: float | None = None
    win_units: int = 0
    prev_units: int = 0
    cleared: bool = False       # a "records again" was sent once since the agent started


class YieldWatch:
    def __init__(self, lines: int, after: float, min_lines: int) -> None:
        """``lines``: 0 turns the watch off."""
        self.lines, self.after, self.min_lines = lines, after, min_lines
        self.tracks: dict[str, _Track] = {}
        self._blind: set[str] = set()  # paths whose verdict stands
        self._runs: dict[Labels, set[str]] = {}  # run -> its followed files

    @property
    def blind(self) -> int:
        """Files whose verdict stands (the ``log_files_unrecognized`` gauge)."""
        return len(self._blind)

    def verdicts(self) -> dict[str, str]:
        """path -> reason (``unrecognized`` | ``stopped``) of the files whose verdict stands."""
        tracks = self.tracks
        return {p: r for p in list(self._blind) if (t := tracks.get(p)) is not None and (r := t.alerted)}

    def update(self, path: str, labels: Labels, units: int, records: int, now: float,
               samples: Callable[[], list[str]]) -> list[Sample]:
        """Take a file's totals after a read; the verdict samples to judge (usually none)."""
        if not self.lines:
            return []
        t = self.tracks.get(path)
        if t is None:
            run = tuple(kv for kv in labels if kv[0] != "rank")
            files = self._runs.get(run)
            if files is None:
                files = self._runs[run] = set()
            else:  # the run's files share one labels tuple (10,000 ranks of one run: one tuple)
                run = self.tracks[next(iter(files))].run
            t = self.tracks[path] = _Track(run, labels)
            files.add(path)
            t.size0 = _size(path)
        if units == t.units and records == t.records:
            return []
        grown, t.units = units - t.units, units
        if records > t.records:
            t.records = records
            return self._records_came(path, t, units - grown, now)
        if t.mark_time is None:
            t.mark_time = now
        self._roll(t, now, units - grown)
        if t.alerted:
            if self._run_fed(t):
                return [self._verdict(path, t, 0.0, now, samples)]
            return [self._verdict(path, t, 1.0, now, samples)] if now - t.sent >= RESEND_S else []
        reason = UNRECOGNIZED if t.last_record is None else STOPPED
        if not self._quiet_too_long(path, t, now, reason) or self._run_fed(t):
            return []
        t.alerted = reason
        return [self._verdict(path, t, 1.0, now, samples)]

    def forget(self, path: str, now: float) -> list[Sample]:
        """The file is no longer followed (gone): its verdict, if any, is withdrawn."""
        t = self.tracks.pop(path, None)
        if t is None:
            return []
        run = self._runs.get(t.run, set())
        run.discard(path)
        if not run:
            self._runs.pop(t.run, None)
        if not t.alerted:
            return []
        return [self._verdict(path, t, 0.0, now, lambda: [])]

    # -- internals -------------------------------------------------------------------------------
    def _records_came(self, path: str, t: _Track, units_before: int, now: float) -> list[Sample]:
        if t.last_record is not None and t.mark_time is not None:  # a gap between two records ended
            t.max_gap_units = max(t.max_gap_units, units_before - t.mark_units)
            t.max_gap_s = max(t.max_gap_s, now - t.mark_time)
        t.mark_units, t.mark_time, t.last_record, t.win_time = t.units, None, now, None
        out = []
        if t.alerted or not t.cleared:
            out.append(self._verdict(path, t, 0.0, now, lambda: []))
        # the run is not blind: its other files' verdicts are withdrawn too
        if self._blind:
            for other_path in self._runs.get(t.run, ()):
                o = self.tracks[other_path]
                if o.alerted and o is not t:
                    out.append(self._verdict(other_path, o, 0.0, now, lambda: []))
        return out

    def _quiet_too_long(self, path: str, t: _Track, now: float, reason: str) -> bool:
        units = t.units - t.mark_units
        lines, after = self.lines, self.after
        if reason == STOPPED:
            lines = max(lines, STOP_GAP_FACTOR * t.max_gap_units)
            after = max(after, STOP_GAP_FACTOR * t.max_gap_s)
        elapsed = now - t.mark_time if t.mark_time is not None else 0.0
        # the time rule asks for steady growth: min_lines in the last half to whole window (a
        # burst of start-up output, then a long silent checkpoint load, is no blindness)
        if not (units >= lines or (elapsed >= after and t.units - t.prev_units >= self.min_lines)):
            return False
        if not t.grew:  # a file only read (a static .txt, a finished log), never written to, is no live log
            t.grew = _size(path) > t.size0
        return t.grew

    def _roll(self, t: _Track, now: float, units_before: int) -> None:
        """Move the half windows of recent growth on (see _Track)."""
        if t.win_time is None:  # a stretch without records begins
            t.win_time, t.win_units = now, units_before
            t.prev_units = units_before
        elif now - t.win_time >= self.after:  # silent for a whole window: growth starts afresh
            t.win_time, t.win_units = now, units_before
            t.prev_units = units_before
        elif now - t.win_time >= self.after / 2:
            t.prev_units = t.win_units
            t.win_time, t.win_units = now, units_before

    def _run_fed(self, t: _Track) -> bool:
        """Another file of the same run yields records (it had some, and no verdict stands on it)."""
        tracks = self.tracks
        return any((o := tracks[p]) is not t and o.last_record is not None and not o.alerted for p in self._runs.get(t.run, ()))

    def _verdict(self, path: str, t: _Track, value: float, now: float,
                 samples: Callable[[], list[str]]) -> Sample:
        if value:
            t.sent = now
            self._blind.add(path)
            attrs: tuple[tuple[str, object], ...] = (
                ("reason", t.alerted), ("units", t.units - t.mark_units), ("records", t.records),
                ("since", t.mark_time), ("sample", "\n".join(samples()[-SAMPLE_LINES:])))
        else:
            t.alerted, t.cleared, attrs = None, True, ()
            self._blind.discard(path)
        # = make_labels(dict(t.labels), file=path), with the file's own pairs (one set per followed file)
        labels = tuple(sorted([*(kv for kv in t.labels if kv[0] != "file"), ("file", path)]))
        return Sample(labels, LOG_UNRECOGNIZED, value, None, SourcePos(path, 0), now, None, attrs, "")


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1
