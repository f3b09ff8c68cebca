"""Per-producer log parsers and the registry that picks them per file.

Adding a producer = adding one module to this package with a ``Parser`` subclass; it is found
at import. ``Parser.priority`` orders them: when two parsers claim the same line, the one with
the lower priority number wins (specific producers before generic fallbacks).
"""

from __future__ import annotations

from itertools import filterfalse
from operator import attrgetter

from ...registry import discover
from .base import Block, Parser, Record


PARSERS: tuple[type[Parser], ...] = tuple(sorted(discover(__name__, __path__, Parser, "name"),
                                                 key=lambda c: (c.priority, c.name)))
FORMATS: tuple[str, ...] = tuple(p.name for p in PARSERS)


FALLBACK_PRIORITY = 90  # parsers at or above this priority are generic fallbacks
_BY_POS = attrgetter("pos")


class UnknownFormat(ValueError):
    pass


class CompositeParser:
    """Runs every candidate parser over a block and merges their records in line order.

    ``format`` reports the producer that contributed most records so far (a file may mix a
    trainer's lines with a framework's, e.g. DeepSpeed messages inside a Megatron log).
    """

    def __init__(self, fmt: str = "auto", pattern: str | None = None) -> None:
        """``fmt``: "auto" (every producer), a producer name, or "custom" (only ``pattern``).
        ``pattern``: a user-defined regex format, tried before the built-in producers."""
        if fmt in ("auto", "custom"):
            classes = PARSERS if fmt == "auto" else ()
        else:
            classes = tuple(p for p in PARSERS if p.name == fmt)
            if not classes:
                raise UnknownFormat(f"unknown log format {fmt!r}; known: auto, custom, {', '.join(FORMATS)}")
        self.parsers: list[Parser] = [cls() for cls in classes]
        if pattern is not None:
            from .custom import RegexParser
            try:
                self.parsers.insert(0, RegexParser(pattern))
            except ValueError as exc:
                raise UnknownFormat(str(exc)) from None
        elif fmt == "custom":
            raise UnknownFormat("format 'custom' needs a pattern")
        self.fixed = fmt != "auto"
        self.counts: dict[str, int] = {p.name: 0 for p in self.parsers}
        self.errors: list[str] = []  # parser failures, drained by the reader that owns this parser
        self._specific: dict[str, bool] = {p.name: p.priority < FALLBACK_PRIORITY for p in self.parsers}

    @property
    def format(self) -> str | None:
        # a generic fallback (user prints, JSON lines) names the format only when no specific
        # producer matched: DeepSpeed's messages make a DeepSpeed log even among many user prints
        best = max(self.counts.items(), key=lambda kv: (kv[1] > 0 and self._specific[kv[0]], kv[1]),
                   default=(None, 0))
        return best[0] if best[1] > 0 else None

    def parse(self, block: Block) -> list[Record]:
        """Run the parsers in priority order. Lines a parser claimed are blanked (same length,
        so positions and line numbers hold) before the next parser looks: a later parser's
        keyword pre-filter then skips blocks it has nothing left to read in, and generic
        fallbacks never rescan what a specific producer already read."""
        merged: list[Record] = []
        current = block
        probe = block.text
        lines: list[str] | None = None
        for parser in self.parsers:
            if not parser.wants(probe):  # keywords are looked for in unclaimed lines only
                continue
            try:
                records = parser.parse(current)
            except Exception as exc:  # a parser bug must not wedge the file: skip it for this block
                self.errors.append(f"{parser.name} parser failed on lines {block.first_line}..: {exc!r}")
                continue
            if not records:
                continue
            self.counts[parser.name] += len(records)
            merged.extend(records)
            if lines is None:
                lines = block.text.split("\n")
            first = block.first_line
            for ln in {r.line for r in records}:
                i = ln - first
                lines[i] = " " * len(lines[i])
            current = block.with_text("\n".join(lines))
            # whitespace-only lines hold no keyword, and no keyword spans a newline
            probe = "\n".join(filterfalse(str.isspace, lines))
        if len(merged) > 1:  # timsort: one C-level pass when already in order
            merged.sort(key=_BY_POS)  # positions share one layout: text order is line order
        return merged


__all__ = ["Block", "CompositeParser", "FORMATS", "PARSERS", "Parser", "Record", "UnknownFormat"]
