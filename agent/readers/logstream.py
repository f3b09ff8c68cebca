"""One followed log file: tailer → normaliser → parsers → typed samples.

The daemon keeps one ``LogStream`` per watched log; ``replay`` runs one over a finished file.
Both therefore read, normalise and parse with exactly the same code.
"""

from __future__ import annotations

import time as _time
from dataclasses import dataclass
from typing import Callable, Mapping

from ..model import Labels, Sample, SourcePos, SourcePosDraft, far_apart, gc_paused, make_labels
from .parsers import Block, CompositeParser
from .parsers.base import strip_ansi
from .tailer import LogTailer, TailPosition, TextBlock
from .yields import chatter, tail_lines


DUP_RECORDS = 32  # how many lines after the original a copy is still recognised


@dataclass(slots=True)
class StreamStats:
    lines: int = 0
    bytes: int = 0
    records: int = 0
    truncated_lines: int = 0
    duplicates: int = 0
    chatter: int = 0  # blank lines, progress-bar frames, NCCL debug lines of blocks without a record (yields.py)
    skipped: int = 0  # records of a structured metric file not read (bad CRC, damaged): filecursor.py


_INTERNED: dict[Labels, Labels] = {}  # equal label sets of different files share one tuple
_INTERNED_MAX = 1 << 16


_PAIRS: dict[tuple[str, str], tuple[str, str]] = {}  # and equal pairs of unequal sets: ("run", "x") of every rank


def _intern(labels: Labels) -> Labels:
    if len(_INTERNED) >= _INTERNED_MAX:
        _INTERNED.clear()  # tuples already handed out stay valid; only sharing restarts
        _PAIRS.clear()
    if (known := _INTERNED.get(labels)) is not None:
        return known
    labels = tuple(_PAIRS.setdefault(kv, kv) for kv in labels)
    return _INTERNED.setdefault(labels, labels)


_OPTIONS: dict[tuple[int, int, object], tuple[int, int, object]] = {}  # the tailers' options, shared


def _options(*opts: object) -> tuple[int, int, Callable[[str, int], None] | None]:
    if len(_OPTIONS) >= 64:
        _OPTIONS.clear()
    return _OPTIONS.setdefault(opts, opts)  # type: ignore[arg-type, return-value]


class LogStream:
    """Everything kept per followed file (ten thousand of them must fit in tens of MB): the
    tailer, this file's counts and per-file parsers, the labels and the last record of each
    producer for the copy filter. Parser instances are shared between files.

    A closed stream (an idle file past ``limits.max_open_files``, see ``close``) keeps less: its
    tailer's position instead of the tailer, the parser as a tuple of its counts, the copy filter's
    one producer as a tuple, only the records a later copy could still be compared with. The next
    ``poll`` (or ``tailer``) makes each again, equal to what was there."""

    __slots__ = ("path", "base_labels", "_parser", "_tailer", "_opts", "stats", "_labels_cache", "_last",
                 "_no_copies", "_generation", "_unparsed")

    def __init__(self, path: str, labels: Mapping[str, str] | None = None, fmt: str = "auto",
                 position: TailPosition | None = None, *, start_at_end: bool = False,
                 max_line_bytes: int = 1 << 20, chunk_bytes: int = 1 << 20, pattern: str | None = None,
                 check_open: Callable[[str, int], None] | None = None) -> None:
        self.path = path
        self.base_labels = _intern(make_labels(labels))
        self._parser: CompositeParser | tuple[object, ...] = CompositeParser(fmt, pattern)  # UnknownFormat
        self._opts = _options(max_line_bytes, chunk_bytes, check_open)
        self._tailer: LogTailer | TailPosition = LogTailer(
            path, position, start_at_end=start_at_end, max_line_bytes=max_line_bytes, chunk_bytes=chunk_bytes,
            check_open=check_open)
        self.stats = StreamStats()
        # rank -> labels, for records that name their rank (made at the first: most files have none)
        self._labels_cache: dict[str, Labels] | None = None
        # producer -> (hash of its last record's text, line, log time): the copy filter keeps a
        # hash, not the text, so that ten thousand idle files do not each hold their last record;
        # closed at rest with one producer: (producer, hash, line, log time) (see close)
        self._last: dict[str, tuple[int, int, float | None]] | tuple = {}
        self._no_copies = self._parser.no_copies
        self._generation: tuple[int, int] | None = None
        self._unparsed: list[str] | None = None  # the last lines of blocks without a record (yields.py)

    @property
    def format(self) -> str | None:
        p = self._parser
        return p.format if type(p) is CompositeParser else CompositeParser.format_of(p[2:])  # type: ignore[index]

    @property
    def parser(self) -> CompositeParser:
        p = self._parser
        if type(p) is not CompositeParser:  # at rest (see close)
            p = self._parser = CompositeParser.revived(p)  # type: ignore[arg-type]
        return p  # type: ignore[return-value]

    @property
    def position(self) -> TailPosition | None:
        t = self._tailer
        return t if type(t) is TailPosition else t.position  # type: ignore[union-attr]

    @property
    def tailer(self) -> LogTailer:
        t = self._tailer
        if type(t) is TailPosition:  # closed at rest (see close): the same tailer again
            if type(last := self._last) is tuple:  # and the copy filter, of the position's generation
                self._last, self._generation = {last[0]: last[1:]}, (t.dev, t.ino)
            mx, chunk, check = self._opts
            t = self._tailer = LogTailer(self.path, t, max_line_bytes=mx, chunk_bytes=chunk, check_open=check,
                                         lazy=True)
        return t  # type: ignore[return-value]

    @property
    def is_open(self) -> bool:
        """Whether the file's descriptor is held (without making a tailer at rest again)."""
        t = self._tailer
        return type(t) is LogTailer and t.is_open

    def poll(self, budget_bytes: int = 16 << 20, now: float | None = None) -> list[Sample]:
        """Samples from the complete lines appended since the last call."""
        return self._samples(self.tailer.read(budget_bytes), now)

    def finish(self, now: float | None = None) -> list[Sample]:
        """At the end of a finished file: the last line even without its newline."""
        blocks: list[TextBlock] = []
        while True:
            more = self.tailer.read(1 << 30)
            block = self.tailer.flush_partial() if not more else None
            if not more and block is None:
                break
            blocks.extend(more)
            if block is not None:
                blocks.append(block)
        return self._samples(blocks, now)

    def close(self) -> None:
        """Release the descriptor and keep less while the file idles (see the class); a later
        ``poll`` opens the file again where it was read to."""
        if type(p := self._parser) is CompositeParser:
            self._parser = p.rest() or p
        t = self._tailer
        if type(t) is not LogTailer:
            return
        t.close()
        pos = t.at_rest()
        if pos is None:
            return
        self._tailer = pos  # the next read is of the position's generation: from its line + 1 on
        last = self._last
        if self._generation != (pos.dev, pos.ino):
            last.clear()  # the next block would clear it (another generation)
        floor = pos.line + 1 - DUP_RECORDS
        for producer in [p for p, prev in last.items() if prev[1] < floor]:
            del last[producer]  # no later record can be a copy of it any more
        if len(last) <= 1:  # the generation is the position's again when the tailer is (see tailer)
            self._generation = None  # (it only tells when to clear the copy filter: empty, or one)
            if last:
                (producer, prev), = last.items()
                self._last = (producer, *prev)

    def sample_lines(self) -> list[str]:
        """A few of the last lines read since the last record (cleaned, bounded): what the file
        holds when no parser recognises it."""
        return list(self._unparsed or ())

    def _labels(self, rank: str) -> Labels:
        """The labels of a record that names its rank (cached per file, shared between files)."""
        cache = self._labels_cache
        if cache is None:
            cache = self._labels_cache = {}
        lab = cache.get(rank)
        if lab is None:
            lab = cache[rank] = _intern(make_labels(dict(self.base_labels), rank=rank))
        return lab

    def _samples(self, blocks: list[TextBlock], now: float | None) -> list[Sample]:
        if not blocks:
            return []
        with gc_paused():
            return self._read_blocks(blocks, now)

    def _read_blocks(self, blocks: list[TextBlock], now: float | None) -> list[Sample]:
        """Samples of the records in ``blocks``, less copies. A copy is the same record printed
        again by another rank or log handler: the same text (from the record's start to the end
        of its line) as the *previous* record of the same producer, at most DUP_RECORDS lines
        later and, where lines are stamped, at the same moment. Prefixes such as timestamps and
        ranks are not compared; an identical record after a different one of the same producer
        is a genuine repeat, not a copy. (Not asked for producers that never print copies: see
        ``Parser.copies``.) This loop runs once per record, hence everything inline: samples are
        built without their ``__init__`` (every field set here), the position as ``source_pos`` builds it."""
        out: list[Sample] = []
        append = out.append
        t = _time.time() if now is None else now
        path, no_copies, base, last, new = self.path, self._no_copies, self.base_labels, self._last, object.__new__
        labels_of = self._labels_cache
        draft, parser = SourcePosDraft, self.parser
        stats = self.stats
        for tb in blocks:
            if tb.generation != self._generation:  # rotation/truncation: line numbers restart
                self._generation = tb.generation
                last.clear()
            stats.lines += tb.n_lines
            stats.bytes += tb.end_offset - tb.start_offset
            stats.truncated_lines += tb.truncated_lines
            # ANSI colour codes never contain a newline, so stripping keeps line numbers exact
            block = Block(strip_ansi(tb.text), tb.first_line)
            records = parser.parse(block)
            n_records = len(records) - parser.hint_records
            stats.records += n_records
            if n_records:
                self._unparsed = None
            else:
                stats.chatter += chatter(block.text)
                if self._unparsed is None:
                    self._unparsed = []
                tail_lines(block.text, self._unparsed)
            text = block.text
            held, prev = None, None  # the producer whose last record is in ``prev`` (not in ``last``)
            for rec in records:
                producer, line, log_time = rec.producer, rec.line, rec.log_time
                if producer not in no_copies:
                    pos, end = rec.pos, rec.end
                    if end < 0:
                        end = text.find("\n", pos)
                    key = hash((text[pos:end] if end >= 0 else text[pos:]).rstrip())
                    if producer is not held:  # records of one producer mostly follow each other
                        if held is not None:
                            last[held] = prev
                        held, prev = producer, last.get(producer)
                    if prev is not None and prev[0] == key and 0 <= line - prev[1] <= DUP_RECORDS \
                            and not far_apart(prev[2], log_time):
                        prev = (key, line, log_time)
                        stats.duplicates += 1
                        continue
                    prev = (key, line, log_time)
                rank = rec.rank
                if rank is None:
                    labels = base
                elif labels_of is None or (labels := labels_of.get(rank)) is None:
                    labels = self._labels(rank)
                    labels_of = self._labels_cache
                src = draft()  # model.source_pos, inline
                src.path = path
                src.line = line
                src.offset = -1
                src.__class__ = SourcePos
                step = rec.step
                for metric, value, attrs in rec.values:
                    smp = new(Sample)
                    smp.labels = labels
                    smp.metric = metric
                    smp.value = value
                    smp.step = step
                    smp.source = src
                    smp.time = t
                    smp.log_time = log_time
                    smp.attrs = attrs
                    smp.producer = producer
                    append(smp)
            if held is not None:
                last[held] = prev
        return out


# ``_read_blocks`` sets every field of a sample itself: a field added to Sample must be set there too
assert Sample.__slots__ == ("labels", "metric", "value", "step", "source", "time", "log_time", "attrs", "producer")
