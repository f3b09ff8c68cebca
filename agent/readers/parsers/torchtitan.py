"""torchtitan training lines.

``[rank0]:[titan] <ts> - root - INFO - step: <i>  loss: <f>  grad_norm: <f>  memory: ...``.
Traps handled here: older versions have no ``[titan]`` and no ``grad_norm``; colour codes left
half-stripped (``[31mstep:``, ``mloss:``, ``mmemory:``) around fields; padded values
(``step:  2  loss:  8.4157``); non-final pipeline-parallel stages log the sentinel
``loss: -1.0000``, which is not a loss (skipped; the grad norm of such a line is kept, and the
record is kept even without values so that no generic fallback parser reads -1.0 from the line).
"""

from __future__ import annotations

import re

from ...model import GRAD_NORM, LEARNING_RATE, LOSS
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_C = r"(?:\[[\d;]*m|m)?"  # a colour-code leftover before a field name
_RE = re.compile(
    rf"(?<![A-Za-ln-z_])step:\s*(?P<step>\d+)\s+{_C}loss:\s*(?P<loss>{FLOAT})"
    rf"(?:\s+{_C}grad_norm:\s*(?P<gn>{FLOAT}))?(?:[^\n]{{0,400}}?(?<![\w.])lr:\s*(?P<lr>{FLOAT}))?"
)


class TorchtitanParser(Parser):
    name = "torchtitan"
    priority = 40
    keywords = ("step:",)

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            pos = m.start()
            rec = self.record(block, pos, to_step(m.group("step")))
            loss = to_float(m.group("loss"))
            if loss is not None and loss != -1.0:  # -1.0: pipeline stage without the loss
                rec.add(LOSS, loss)
            for grp, metric in (("gn", GRAD_NORM), ("lr", LEARNING_RATE)):
                if m.group(grp) is not None and (v := to_float(m.group(grp))) is not None:
                    rec.add(metric, v)
            out.append(rec)  # a sentinel-only line still claims its line (no fallback reads -1.0)
        return out
