"""Per-producer log parsers and the registry that picks them per file.

Adding a producer = one module with a ``Parser`` subclass, listed in ``PARSERS``. Order is
priority: when two parsers claim the same line, the earlier one wins.
"""

from __future__ import annotations

from .base import Block, Parser, Record
from .deepspeed import DeepSpeedParser
from .megatron import MegatronParser

PARSERS: tuple[type[Parser], ...] = (MegatronParser, DeepSpeedParser)
FORMATS: tuple[str, ...] = tuple(p.name for p in PARSERS)


class UnknownFormat(ValueError):
    pass


class CompositeParser:
    """Runs every candidate parser over a block and merges their records in line order.

    ``format`` reports the producer that contributed most records so far (a file may mix a
    trainer's lines with a framework's, e.g. DeepSpeed messages inside a Megatron log).
    """

    def __init__(self, fmt: str = "auto") -> None:
        if fmt == "auto":
            classes = PARSERS
        else:
            classes = tuple(p for p in PARSERS if p.name == fmt)
            if not classes:
                raise UnknownFormat(f"unknown log format {fmt!r}; known: auto, {', '.join(FORMATS)}")
        self.parsers: list[Parser] = [cls() for cls in classes]
        self.fixed = fmt != "auto"
        self.counts: dict[str, int] = {p.name: 0 for p in self.parsers}

    @property
    def format(self) -> str | None:
        best = max(self.counts.items(), key=lambda kv: kv[1], default=(None, 0))
        return best[0] if best[1] > 0 else None

    def parse(self, block: Block) -> list[Record]:
        merged: list[Record] = []
        claimed: set[int] = set()
        for parser in self.parsers:
            if not parser.wants(block.text):
                continue
            records = parser.parse(block)
            if merged:
                records = [r for r in records if r.line not in claimed]
            if records:
                self.counts[parser.name] += len(records)
                claimed.update(r.line for r in records)
                merged.extend(records)
        if len(merged) > 1:
            merged.sort(key=lambda r: r.pos)
        return merged


__all__ = ["Block", "CompositeParser", "FORMATS", "PARSERS", "Parser", "Record", "UnknownFormat"]
