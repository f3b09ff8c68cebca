"""detectron2 ``d2.utils.events`` metric lines and its non-finite-loss abort.

``[06/14 03:58:22 d2.utils.events]: eta: 3:27:16  iter: 519  total_loss: 1.382  loss_cls: 0.913
...  lr: 0.005198  max_mem: 5216M``: ``total_loss`` -> ``loss`` (the ``loss_*`` parts are not the
total), ``lr``, step = ``iter``. ``FloatingPointError: Loss became infinite or NaN at
iteration=<i>!`` -> one ``nonfinite_message`` (what="loss", step <i>). The following
``loss_dict = {... tensor(nan, device=...) ...}`` (possibly wrapped over lines) is ignored: the
message already reports the event.
"""

from __future__ import annotations

import re

from ...model import GRAD_NORM, LEARNING_RATE, LOSS, NONFINITE_MESSAGE
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_RE = re.compile(
    rf"\biter:\s*(?P<it>\d+)\s+total_loss:\s*(?P<loss>{FLOAT})(?P<rest>[^\n]*)"
    r"|Loss became infinite or NaN at iteration=(?P<bad>\d+)"
)
_LR_RE = re.compile(rf"(?<![\w.])lr:\s*({FLOAT})")
_GN_RE = re.compile(rf"(?<![\w.])(?:grad_norm|total_grad_norm):\s*({FLOAT})")


class Detectron2Parser(Parser):
    name = "detectron2"
    priority = 40
    keywords = ("total_loss", "Loss became infinite")

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            pos = m.start()
            rec = self.record(block, pos)
            if m.group("bad") is not None:
                rec.step = to_step(m.group("bad"))
                rec.add(NONFINITE_MESSAGE, 1.0, what="loss")
            else:
                rec.step = to_step(m.group("it"))
                if (v := to_float(m.group("loss"))) is not None:
                    rec.add(LOSS, v)
                for rx, metric in ((_GN_RE, GRAD_NORM), (_LR_RE, LEARNING_RATE)):
                    if (f := rx.search(m.group("rest"))) and (v := to_float(f.group(1))) is not None:
                        rec.add(metric, v)
            if rec.values:
                out.append(rec)
        return out
