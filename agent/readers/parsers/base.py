"""The line-parser interface and the helpers every producer's parser shares.

Parsers work on *blocks* of complete lines rather than one line at a time: a regex scan over a
whole block runs in C, which is what lets parsing keep up with a fast-writing trainer while the
agent stays in the background. A parser finds its records anywhere inside a line (records are
glued after progress-bar frames in real logs), and reports each with its 1-based line number.
"""

from __future__ import annotations

import abc
import bisect
import calendar
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")

# A float as trainers print it: plain, scientific in either case, Python/Lightning NaN forms.
FLOAT = r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan(?:\.0)?|NaN|inf|Inf|infinity|Infinity)"

_SPECIAL = {"nan": math.nan, "nan.0": math.nan, "-nan": math.nan, "+nan": math.nan,
            "inf": math.inf, "+inf": math.inf, "infinity": math.inf, "+infinity": math.inf,
            "-inf": -math.inf, "-infinity": -math.inf}


def to_float(text: str) -> float | None:
    """Parse a printed number; None when it is not one (never raises)."""
    try:
        return float(text)
    except ValueError:
        return _SPECIAL.get(text.strip().strip("'\"").lower())


STEP_MAX = 1 << 63  # a step beyond int64 is no step (and int() of 4300+ digits raises)


def to_step(value: str | float | None) -> int | None:
    """A step number from matched digits or a finite float; None when it is not one or does not
    fit in 64 bits (never raises: a line of 5000 digits must not cost the parser its block)."""
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > 19:
            return None
        try:
            n = int(value)
        except ValueError:
            return None
    else:
        if not math.isfinite(value) or abs(value) >= STEP_MAX:
            return None
        n = int(value)
    return n if -STEP_MAX < n < STEP_MAX else None


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text) if "\x1b" in text else text


_TS_RE = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[,.](\d{1,6}))?")
_RANK_PREFIX_RE = re.compile(r"\s*(?:> )?\s*\[(?:rank|default)\s*(\d+)\]:")
_TS_SEARCH, _RANK_MATCH = _TS_RE.search, _RANK_PREFIX_RE.match


_TS_CACHE: dict[str, float] = {}  # "YYYY-MM-DD HH:MM" -> seconds; stamps share their minute
_TS_CACHE_MAX = 4096


def minute_seconds(m: str) -> float | None:
    """Seconds (as if UTC) of a ``YYYY-MM-DD HH:MM`` stamp prefix, None for an impossible date;
    cached, because the lines of one minute share it. Every field has a fixed width."""
    base = _TS_CACHE.get(m)
    if base is None:
        try:
            day = calendar.timegm((int(m[:4]), int(m[5:7]), int(m[8:10]), 0, 0, 0))
            base = float(day + int(m[11:13]) * 3600 + int(m[14:16]) * 60)
        except (ValueError, OverflowError):
            return None
        if len(_TS_CACHE) >= _TS_CACHE_MAX:
            _TS_CACHE.clear()
        _TS_CACHE[m] = base
    return base


def _stamp_seconds(s: str) -> float | None:
    """Seconds (as if UTC) of a stamp ``_TS_RE`` matched; the minute is converted once per minute."""
    base = _TS_CACHE.get(s[:16])
    if base is None and (base := minute_seconds(s[:16])) is None:
        return None
    if len(s) == 19:
        return base + int(s[17:])
    return base + int(s[17:19]) + int(s[20:]) / 10 ** (len(s) - 20)


class Block:
    """A block of text being parsed, with cheap line-number and line-prefix lookups.

    Parsers mostly ask about positions in increasing order, so the line number of the last
    position asked about is kept and the next one counts newlines from there (C speed, no
    per-line Python work); only a step backwards builds the full newline index."""

    __slots__ = ("text", "first_line", "_nl", "_cur_pos", "_cur_line")

    def __init__(self, text: str, first_line: int = 1) -> None:
        self.text = text
        self.first_line = first_line
        self._nl: list[int] | None = None
        self._cur_pos = 0
        self._cur_line = first_line

    def with_text(self, text: str) -> "Block":
        """A block with the same line layout (same newline positions) but other content."""
        other = Block(text, self.first_line)
        other._nl = self._nl
        return other

    def _newlines(self) -> list[int]:
        if self._nl is None:
            text, out, i = self.text, [], self.text.find("\n")
            while i != -1:
                out.append(i)
                i = text.find("\n", i + 1)
            self._nl = out
        return self._nl

    def line_of(self, pos: int) -> int:
        """1-based line number (in the file) of character position ``pos``."""
        cur = self._cur_pos
        if pos >= cur:
            line = self._cur_line + self.text.count("\n", cur, pos)
        else:
            line = self.first_line + bisect.bisect_left(self._newlines(), pos)
        self._cur_pos, self._cur_line = pos, line
        return line

    def line_start(self, pos: int) -> int:
        return self.text.rfind("\n", 0, pos) + 1

    def rank_at(self, pos: int, start: int | None = None) -> str | None:
        """Rank from a stream prefix such as torchrun's ``[rank3]:`` at the start of the line."""
        if start is None:
            start = self.line_start(pos)
        m = _RANK_PREFIX_RE.match(self.text, start, min(pos + 1, start + 40))
        return m.group(1) if m else None

    def log_time_at(self, pos: int, start: int | None = None) -> float | None:
        """Seconds (as if UTC) of a ``YYYY-MM-DD HH:MM:SS[,mmm]`` stamp before ``pos`` on its line."""
        if start is None:
            start = self.line_start(pos)
        m = _TS_RE.search(self.text, start, min(pos, start + 120) if pos > start else start + 120)
        return _stamp_seconds(m.group()) if m else None

    def record(self, pos: int, step: int | None, producer: str,
               values: list[tuple[str, float, tuple[tuple[str, Any], ...]]] | None = None,
               stamp: str | None = None) -> Record:
        """A record for a match at ``pos`` with its line number, stamp and rank: ``line_of``,
        ``log_time_at`` and ``rank_at`` in one call, as it runs once per record. A caller whose
        match already showed that the line starts with blanks and ``[stamp]`` passes ``stamp``:
        it is then the line's first stamp, and there is no rank prefix to look for."""
        text = self.text
        cur = self._cur_pos
        if pos >= cur:
            line = self._cur_line + text.count("\n", cur, pos)
        else:
            line = self.first_line + bisect.bisect_left(self._newlines(), pos)
        self._cur_pos, self._cur_line = pos, line
        if stamp is not None:
            return Record(line, pos, [] if values is None else values, step, _stamp_seconds(stamp), None, producer)
        start = text.rfind("\n", 0, pos) + 1
        m = _TS_SEARCH(text, start, pos if start < pos < start + 120 else start + 120)
        r = _RANK_MATCH(text, start, pos + 1 if pos < start + 40 else start + 40)
        return Record(line, pos, [] if values is None else values, step,
                      _stamp_seconds(m.group()) if m else None, r.group(1) if r else None, producer)


@dataclass(slots=True)
class Record:
    """What one parser read from one line: values plus where and when."""

    line: int
    pos: int                                   # character position in the block (for ordering)
    values: list[tuple[str, float, tuple[tuple[str, Any], ...]]] = field(default_factory=list)
    step: int | None = None
    log_time: float | None = None
    rank: str | None = None
    producer: str = ""
    # where the record's line ends in the block (its newline or the text's end), when the parser
    # knows it for free; -1: the reader looks for it (not part of what the record says)
    end: int = field(default=-1, compare=False, repr=False)

    def add(self, metric: str, value: float, **attrs: Any) -> None:
        self.values.append((metric, value, tuple(attrs.items()) if attrs else ()))


def line_spans(text: str, records: list[Record]) -> list[tuple[int, int]]:
    """``(start, end)`` of the lines the records are on (``end`` at the newline or the end of
    the text), in order, each line once."""
    seen: dict[int, int] = {}
    for r in records:
        start = text.rfind("\n", 0, r.pos) + 1
        if start not in seen:
            end = text.find("\n", r.pos)
            seen[start] = len(text) if end < 0 else end
    return sorted(seen.items())


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted spans with those that overlap (the same lines claimed twice) made one."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


class Parser(abc.ABC):
    """Turns blocks of one producer's log lines into records.

    Instances are shared by every file of a format unless ``per_file`` is set: a parser that
    keeps context from one block to the next (e.g. the last exact loss scale, to match rounded
    prints against) sets it and gets one instance per file, made when the file first needs it.
    ``keywords`` is a cheap pre-filter: a block that contains none of them is skipped without
    running any regex.
    """

    name: ClassVar[str]
    keywords: ClassVar[tuple[str, ...]]
    priority: ClassVar[int] = 50  # lower wins a line two parsers claim; generic fallbacks use 90+
    # False for producers that print one unstamped, step-less line per step (identical lines
    # are then genuine repeats, never copies from other ranks/handlers)
    copies: ClassVar[bool] = True
    per_file: ClassVar[bool] = False  # True when parse() keeps state between blocks of one file
    # True for readers of run-wide facts (parsers/hints.py) that run beside every format: they are
    # no format of their own and do not count when the file's format is decided
    hint: ClassVar[bool] = False
    # True for formats whose files legitimately go long without a record (a kernel log holds a fault
    # now and then among its other lines): a file read as such a format alone is never judged blind
    sparse: ClassVar[bool] = False

    def record(self, block: Block, pos: int, step: int | None = None) -> Record:
        """A record for a match starting at ``pos``: line, timestamp and rank looked up once."""
        return block.record(pos, step, self.name)

    def wants(self, text: str) -> bool:
        return any(k in text for k in self.keywords)

    def parse_spans(self, block: Block) -> tuple[list[Record], list[tuple[int, int]] | None]:
        """``parse`` plus, where the parser knows them for free, the ``(start, end)`` character
        spans of the lines its records are on: whole lines, in order, disjoint, several adjacent
        lines possibly in one span (``end`` at the last one's newline or the end of the text).
        None lets ``CompositeParser`` find each record's line itself."""
        return self.parse(block), None

    @abc.abstractmethod
    def parse(self, block: Block) -> list[Record]:
        """Records found in ``block``, in text order."""
