"""Megatron-LM and Megatron-DeepSpeed iteration and validation lines.

One pipe-separated line per log interval. Traps handled here: ``lm loss``/``grad norm`` are
absent when the whole interval was skipped; ``number of nan iterations: 0`` is a counter, not a
NaN; the validation line's ``lm loss value`` is not a training loss.
"""

from __future__ import annotations

import re

from ...model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, SKIPPED_INTERVAL
from .base import Block, Parser, Record, to_float

_ITER_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|([^\n]*)")
_VALID_RE = re.compile(r"validation loss at iteration\s+(\d+)\s*\|([^\n]*)")
_ITER_FIELDS = (("lm loss:", LOSS), ("loss scale:", LOSS_SCALE), ("grad norm:", GRAD_NORM),
                ("learning rate:", LEARNING_RATE))


def _field(rest: str, key: str) -> float | None:
    """The number after ``key`` up to the next ``|`` (str.find: far cheaper than a regex per field)."""
    i = rest.find(key)
    if i < 0:
        return None
    j = rest.find("|", i)
    return to_float(rest[i + len(key):j if j >= 0 else len(rest)].strip())


class MegatronParser(Parser):
    name = "megatron"
    priority = 10
    keywords = ("iteration",)

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        text = block.text
        for m in _ITER_RE.finditer(text):
            rest = m.group(3)
            if "loss scale:" not in rest and "lm loss:" not in rest and "learning rate:" not in rest:
                continue  # some other "iteration N/M |" text
            pos = m.start()
            rec = self.record(block, pos, int(m.group(1)))
            for key, metric in _ITER_FIELDS:
                if (v := _field(rest, key)) is not None:
                    rec.add(metric, v)
            if v := _field(rest, "number of skipped iterations:"):
                rec.add(SKIPPED_INTERVAL, v)
            if v := _field(rest, "number of nan iterations:"):
                rec.add(NONFINITE_MESSAGE, v, what="nan_iterations")
            out.append(rec)
        if "validation loss" in text:
            for m in _VALID_RE.finditer(text):
                if (v := _field(m.group(2), "lm loss value:")) is None:
                    continue
                pos = m.start()
                rec = self.record(block, pos, int(m.group(1)))
                rec.add(EVAL_LOSS, v)
                out.append(rec)
            out.sort(key=lambda r: r.pos)
        return out
