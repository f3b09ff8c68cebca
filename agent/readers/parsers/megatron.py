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
_FIELD_RE = re.compile(r"\s*([A-Za-z][^:|\n]*?)\s*:\s*([^|\n]*?)\s*(?=\||$)")


def _fields(rest: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) for m in _FIELD_RE.finditer(rest)}


class MegatronParser(Parser):
    name = "megatron"
    priority = 10
    keywords = ("iteration",)

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        text = block.text
        for m in _ITER_RE.finditer(text):
            fields = _fields(m.group(3))
            if "loss scale" not in fields and "lm loss" not in fields and "learning rate" not in fields:
                continue  # some other "iteration N/M |" text
            pos = m.start()
            rec = Record(line=block.line_of(pos), pos=pos, step=int(m.group(1)),
                         log_time=block.log_time_at(pos), rank=block.rank_at(pos), producer=self.name)
            for key, metric in (("lm loss", LOSS), ("loss scale", LOSS_SCALE),
                                ("grad norm", GRAD_NORM), ("learning rate", LEARNING_RATE)):
                raw = fields.get(key)
                if raw is not None and (v := to_float(raw)) is not None:
                    rec.add(metric, v)
            if (raw := fields.get("number of skipped iterations")) is not None and (v := to_float(raw)):
                rec.add(SKIPPED_INTERVAL, v)
            if (raw := fields.get("number of nan iterations")) is not None and (v := to_float(raw)):
                rec.add(NONFINITE_MESSAGE, v, what="nan_iterations")
            out.append(rec)
        if "validation loss" in text:
            for m in _VALID_RE.finditer(text):
                raw = _fields(m.group(2)).get("lm loss value")
                if raw is None or (v := to_float(raw)) is None:
                    continue
                pos = m.start()
                rec = Record(line=block.line_of(pos), pos=pos, step=int(m.group(1)),
                             log_time=block.log_time_at(pos), rank=block.rank_at(pos), producer=self.name)
                rec.add(EVAL_LOSS, v)
                out.append(rec)
            out.sort(key=lambda r: r.pos)
        return out
