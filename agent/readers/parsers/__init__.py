"""Per-producer log parsers and the registry that picks them per file.

Adding a producer = adding one module to this package with a ``Parser`` subclass; it is found
at import. ``Parser.priority`` orders them: when two parsers claim the same line, the one with
the lower priority number wins (specific producers before generic fallbacks).
"""

from __future__ import annotations

import functools
from operator import attrgetter

from ...registry import discover
from .base import Block, Parser, Record, line_spans, merge_spans


PARSERS: tuple[type[Parser], ...] = tuple(sorted(discover(__name__, __path__, Parser, "name"),
                                                 key=lambda c: (c.priority, c.name)))
FORMATS: tuple[str, ...] = tuple(p.name for p in PARSERS if not p.hint)


FALLBACK_PRIORITY = 90  # parsers at or above this priority are generic fallbacks
_FALLBACKS = frozenset(p.name for p in PARSERS if p.priority >= FALLBACK_PRIORITY)
_BY_POS = attrgetter("pos")


class UnknownFormat(ValueError):
    pass


@functools.lru_cache(maxsize=None)
def _lineup(fmt: str) -> tuple[Parser, ...]:
    """The parser objects for a format, built once and shared by every file of that format:
    with ten thousand followed files, one set of instances per file was a tenth of the
    daemon's memory. A ``per_file`` parser's shared object only answers ``wants``; each file
    parses with its own (see ``CompositeParser._own``)."""
    return tuple(cls() for cls in (PARSERS if fmt == "auto" else (p for p in PARSERS if p.name == fmt or p.hint)))


@functools.lru_cache(maxsize=256)
def _custom(pattern: str) -> Parser:
    """One stateless ``RegexParser`` per distinct user pattern (raises ValueError for a bad one)."""
    from .custom import RegexParser
    return RegexParser(pattern)


class CompositeParser:
    """Runs every candidate parser over a block and merges their records in line order.

    ``format`` reports the producer that contributed most records so far (a file may mix a
    trainer's lines with a framework's, e.g. DeepSpeed messages inside a Megatron log).
    Per file it holds only counts and the parsers that keep per-file context; ``compact`` (an idle
    file's stream closed) packs the counts into a flat tuple and drops an empty error list, both
    made again by the next ``parse``.
    """

    __slots__ = ("parsers", "fixed", "counts", "_errors", "_own", "hint_records")

    def __init__(self, fmt: str = "auto", pattern: str | None = None) -> None:
        """``fmt``: "auto" (every producer), a producer name, or "custom" (only ``pattern``).
        ``pattern``: a user-defined regex format, tried before the built-in producers."""
        if fmt not in ("auto", "custom") and fmt not in FORMATS:
            raise UnknownFormat(f"unknown log format {fmt!r}; known: auto, custom, {', '.join(FORMATS)}")
        self.parsers: tuple[Parser, ...] = _lineup(fmt if fmt != "custom" else "")
        if pattern is not None:
            try:
                self.parsers = (_custom(pattern), *self.parsers)
            except ValueError as exc:
                raise UnknownFormat(str(exc)) from None
        elif fmt == "custom":
            raise UnknownFormat("format 'custom' needs a pattern")
        self.fixed = fmt != "auto"
        # producer -> records so far (only producers seen); compacted: (name, n, name, n, ...)
        self.counts: dict[str, int] | tuple[str | int, ...] = {}
        self._errors: list[str] | None = None  # see ``errors``
        self._own: dict[str, Parser] | None = None  # this file's instances of per_file parsers
        self.hint_records = 0  # records of hint parsers in the last parse (no training records)

    @property
    def sparse(self) -> bool:
        """Whether this file is read as a sparse format alone (``Parser.sparse``): no blindness verdict."""
        return self.fixed and all(p.sparse for p in self.parsers if not p.hint)

    @property
    def no_copies(self) -> frozenset[str]:
        """Producers whose identical lines are genuine repeats (``Parser.copies`` False)."""
        return _no_copies(self.parsers)

    @property
    def errors(self) -> list[str]:
        """Parser failures, drained (read, then cleared) by the reader that owns this parser."""
        if self._errors is None:
            self._errors = []
        return self._errors

    def compact(self) -> None:
        """Hold less while the file idles (10,000 followed files): the counts as a flat tuple
        instead of a dict, no empty error list. ``parse`` and ``errors`` make them again."""
        if not self._errors:
            self._errors = None
        if type(self.counts) is dict:
            self.counts = tuple(x for kv in self.counts.items() for x in kv)

    def rest(self) -> tuple[object, ...] | None:
        """This parser packed for an idle file: ``(parsers, fixed, name, n, ...)``, which
        ``revived`` makes a parser again and ``format_of`` reads; None (and compacted) while it
        holds per-file parser context or errors."""
        self.compact()
        if self._own is not None or self._errors:
            return None
        return (self.parsers, self.fixed, *self.counts)

    @classmethod
    def revived(cls, rest: tuple[object, ...]) -> CompositeParser:
        p = cls.__new__(cls)
        p.parsers, p.fixed, p.counts = rest[0], rest[1], rest[2:]  # type: ignore[assignment]
        p._errors = p._own = None
        p.hint_records = 0
        return p

    def _counts(self) -> dict[str, int]:
        """The counts as a dict (after ``compact``: a new one, kept)."""
        counts = self.counts
        if type(counts) is not dict:
            counts = self.counts = dict(zip(counts[::2], counts[1::2]))  # type: ignore[arg-type]
        return counts  # type: ignore[return-value]

    @property
    def format(self) -> str | None:
        return self.format_of(self.counts)  # (read once: another thread may ask while the reader compacts)

    @staticmethod
    def format_of(counts: dict[str, int] | tuple[object, ...]) -> str | None:
        """The format the counts name (a dict, or compacted: ``name, n, ...``)."""
        # a generic fallback (user prints, JSON lines) names the format only when no specific
        # producer matched: DeepSpeed's messages make a DeepSpeed log even among many user prints
        items = counts.items() if type(counts) is dict else zip(counts[::2], counts[1::2])  # type: ignore[union-attr]
        best = max(items, key=lambda kv: (kv[1] > 0 and kv[0] not in _FALLBACKS, kv[1]),
                   default=(None, 0))
        return best[0] if best[1] > 0 else None

    def _own_instance(self, shared: Parser) -> Parser:
        """This file's own instance of a per-file parser, made the first time it is needed."""
        if self._own is None:
            self._own = {}
        mine = self._own.get(shared.name)
        if mine is None:
            mine = self._own[shared.name] = type(shared)()
        return mine

    def parse(self, block: Block) -> list[Record]:
        """Run the parsers in priority order. Lines a parser claimed are blanked (same length,
        so positions and line numbers hold) before the next parser looks: a later parser's
        keyword pre-filter then skips blocks it has nothing left to read in, and generic
        fallbacks never rescan what a specific producer already read. The blanked text is only
        made when a later parser's keywords are among the unclaimed lines."""
        merged: list[Record] = []
        text = block.text
        current: Block | None = block
        probe = text
        claimed: list[tuple[int, int]] = []  # (start, end) of claimed lines, sorted, disjoint
        in_order = True  # whether ``merged`` is known to be in text order already
        self.hint_records = 0
        for parser in self.parsers:
            if not parser.wants(probe):  # keywords are looked for in unclaimed lines only
                continue
            if parser.per_file:
                parser = self._own_instance(parser)
            if current is None:
                current = _blanked(block, claimed)
            try:
                records, spans = parser.parse_spans(current)
            except Exception as exc:  # a parser bug must not wedge the file: skip it for this block
                self.errors.append(f"{parser.name} parser failed on lines {block.first_line}..: {exc!r}")
                continue
            if not records:
                continue
            if parser.hint:
                self.hint_records += len(records)
            else:
                counts = self._counts()
                counts[parser.name] = counts.get(parser.name, 0) + len(records)
            in_order = not merged and spans is not None  # spans are only given with ordered records
            merged.extend(records)
            if spans is None:  # a record's line is the line of its position
                spans = line_spans(text, records)
            claimed = merge_spans(claimed + spans) if claimed else spans
            probe = _rest(text, claimed)
            current = None
        if not in_order and len(merged) > 1:  # timsort: one C-level pass when already in order
            merged.sort(key=_BY_POS)  # positions share one layout: text order is line order
        return merged


def _rest(text: str, spans: list[tuple[int, int]]) -> str:
    """The text outside ``spans`` (whole lines: no keyword is cut or made up)."""
    rest, prev = [], 0
    for start, end in spans:
        rest.append(text[prev:start])
        prev = end
    rest.append(text[prev:])
    return "".join(rest)


def _blanked(block: Block, spans: list[tuple[int, int]]) -> Block:
    """``block`` with the lines in ``spans`` made blanks, newlines kept (so positions and line
    numbers hold)."""
    text, out, prev = block.text, [], 0
    for start, end in spans:
        out.append(text[prev:start])
        out.append("\n".join(" " * len(line) for line in text[start:end].split("\n")))
        prev = end
    out.append(text[prev:])
    return block.with_text("".join(out))


@functools.lru_cache(maxsize=512)
def _no_copies(parsers: tuple[Parser, ...]) -> frozenset[str]:
    return frozenset(p.name for p in parsers if not p.copies)


__all__ = ["Block", "CompositeParser", "FORMATS", "PARSERS", "Parser", "Record", "UnknownFormat"]
