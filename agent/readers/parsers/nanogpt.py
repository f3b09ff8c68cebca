"""nanoGPT-style training scripts.

``iter <i>: loss <f>, time <f>ms, mfu <f>%`` (per-iteration training loss) and the periodic
estimate ``step <i>: train loss <f>, val loss <f>`` (train -> ``loss``, val -> ``eval_loss``).
Traps handled here: ``loss nan``; lines pasted behind a ``> `` quote or a timestamp; Megatron's
``iteration`` and detectron2's ``iter:`` are not matched (a space and a colon are required).
"""

from __future__ import annotations

import re

from ...model import EVAL_LOSS, LOSS
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_RE = re.compile(
    rf"\biter\s+(?P<it>\d+):\s*loss\s+(?P<loss>{FLOAT})"
    rf"|\bstep\s+(?P<st>\d+):\s*train loss\s+(?P<train>{FLOAT}),\s*val loss\s+(?P<val>{FLOAT})"
)


class NanoGPTParser(Parser):
    name = "nanogpt"
    priority = 55
    keywords = ("iter ", "train loss")

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            pos = m.start()
            step = m.group("it") if m.group("it") is not None else m.group("st")
            rec = self.record(block, pos, to_step(step))
            for grp, metric in (("loss", LOSS), ("train", LOSS), ("val", EVAL_LOSS)):
                if m.group(grp) is not None and (v := to_float(m.group(grp))) is not None:
                    rec.add(metric, v)
            if rec.values:
                out.append(rec)
        return out
