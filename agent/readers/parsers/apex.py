"""NVIDIA apex amp dynamic loss scaler, and the torch_npu (Ascend) two-message variant.

* apex: ``Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to <f>`` (two
  spaces after ``overflow.``; often glued after a tqdm frame; the scale may go below 1 or to a
  subnormal like ``8.095e-320``) -> one ``overflow`` (variant "reduce", ``to``) and the new
  ``loss_scale`` tagged ``decrease=True`` (the message alone proves the back-off).
* torch_npu: ``Gradient overflow. Skipping step`` (one space; each rank prints it and copies can
  be concatenated without a newline: one ``overflow`` per line) and
  ``Loss scaler reducing loss scale to <f>`` -> ``loss_scale`` with ``decrease=True``.
* Not values: ``loss_scale             : dynamic`` banner lines and
  ``Warning: NaN or Inf found in input tensor.`` (a clip warning, not a loss).
"""

from __future__ import annotations

import re

from ...model import LOSS_SCALE, OVERFLOW
from .base import FLOAT, Block, Parser, Record, to_float

_RE = re.compile(
    rf"Gradient overflow\.\s+Skipping step,(?: loss scaler \d+)? reducing loss scale to (?P<to>{FLOAT})"
    rf"|(?P<npu>Gradient overflow\. Skipping step)"
    rf"|Loss scaler reducing loss scale to (?P<nto>{FLOAT})"
)


class ApexParser(Parser):
    name = "apex"
    priority = 30
    keywords = ("Gradient overflow", "reducing loss scale")

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        npu_lines: set[int] = set()
        for m in _RE.finditer(block.text):
            pos = m.start()
            line = block.line_of(pos)
            if m.group("npu"):
                if line in npu_lines:
                    continue  # "...Skipping stepGradient overflow. Skipping step": one per line
                npu_lines.add(line)
            rec = Record(line=line, pos=pos, log_time=block.log_time_at(pos), rank=block.rank_at(pos),
                         producer=self.name)
            if m.group("to") is not None:
                to = to_float(m.group("to"))
                if to is None:
                    continue
                rec.add(OVERFLOW, 1.0, variant="reduce", to=to)
                rec.add(LOSS_SCALE, to, decrease=True)
            elif m.group("npu"):
                # held: every rank prints it, and the back-off message that follows says how many
                # logical events the copies were (agent/series/state.py)
                rec.add(OVERFLOW, 1.0, variant="skip", held=True)
            else:
                to = to_float(m.group("nto"))
                if to is None:
                    continue
                rec.add(LOSS_SCALE, to, decrease=True)
            out.append(rec)
        return out
