"""DeepSpeed fp16 loss-scaler messages (ZeRO ``loss_scaler.py`` and the unfused optimizer).

Every overflow message becomes an ``overflow`` event carrying the scale transition, and the new
scale becomes a ``loss_scale`` sample tagged with where it came from. The series layer uses
those transitions to merge the identical copies each rank prints. ``No Grad overflow for N
iterations`` is not an overflow and is ignored.

DeepSpeed 0.19 logs its dynamic scaler's ``OVERFLOW!`` lines at INFO, which its default logging
does not show; what is left of a collapse is the exception that ends the run
(``deepspeed/runtime/fp16/loss_scaler.py``, ``DynamicLossScaler.update_scale``)::

    Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.

(``[rank0]:`` before it under torchrun-style launchers). It is read only after ``Exception: ``
(the traceback may also show the source line that raises it) and becomes an ``overflow`` event
of variant ``min_scale_exit``: the shipped ``LossScaleCollapse`` rule pages on it with no earlier
back-off seen. The static scaler's ``[deepspeed] OVERFLOW! Skipping step. Gradients are
non-finite, weights were not updated.`` (a WARNING, shown by default) is an overflow event too.
"""

from __future__ import annotations

import re

from ...model import LEARNING_RATE, LOSS_SCALE, OVERFLOW, SKIPPED_CUMULATIVE
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_RE = re.compile(
    rf"OVERFLOW! Rank (?P<zrank>\d+) Skipping step\. Attempted loss scale: (?P<za>{FLOAT}),"
    rf" (?:reducing to (?P<zb>{FLOAT})|but hysteresis is (?P<zh>\d+))"
    rf"|loss scale overflow! Skipping step\. Attempted loss scale: (?P<ua>{FLOAT}), reducing to (?P<ub>{FLOAT})"
    rf"|Grad overflow on iteration:?\s*(?P<git>\d+)"
    rf"|(?P<dir>Reducing|Increasing) dynamic loss scale from (?P<fa>{FLOAT}) to (?P<fb>{FLOAT})"
    rf"|\bstep=(?P<step>\d+), skipped=(?P<skipped>\d+)(?:, lr=\[(?P<lr>[^\],]*))?"
    r"|Exception: (?P<minexit>Current loss scale already at minimum - cannot decrease scale anymore)"
    r"|OVERFLOW! (?P<static>Skipping step\. Gradients are non-finite)"
)


class DeepSpeedParser(Parser):
    name = "deepspeed"
    priority = 20
    keywords = ("loss scale", "step=", "Grad overflow", "OVERFLOW!")

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            pos = m.start()
            rec = self.record(block, pos)
            g = m.groupdict()
            if g["za"] is not None:
                a = to_float(g["za"])
                if g["zb"] is not None:
                    b = to_float(g["zb"])
                    rec.add(OVERFLOW, 1.0, variant="reduce", frm=a, to=b)
                    rec.add(LOSS_SCALE, b, frm=a)
                else:
                    rec.add(OVERFLOW, 1.0, variant="hysteresis", frm=a)
                    rec.add(LOSS_SCALE, a)
            elif g["ua"] is not None:
                a, b = to_float(g["ua"]), to_float(g["ub"])
                rec.add(OVERFLOW, 1.0, variant="reduce", frm=a, to=b)
                rec.add(LOSS_SCALE, b, frm=a)
            elif g["git"] is not None:
                rec.step = to_step(g["git"])
                rec.add(OVERFLOW, 1.0)
            elif g["minexit"] is not None:
                rec.add(OVERFLOW, 1.0, variant="min_scale_exit")
            elif g["static"] is not None:
                rec.add(OVERFLOW, 1.0, variant="static")
            elif g["dir"] is not None:
                a, b = to_float(g["fa"]), to_float(g["fb"])
                rec.add(LOSS_SCALE, b, frm=a)
            else:
                rec.step = to_step(g["step"])
                rec.add(SKIPPED_CUMULATIVE, float(g["skipped"]))
                if g["lr"] and (lr := to_float(g["lr"])) is not None:
                    rec.add(LEARNING_RATE, lr)
            if rec.values or rec.step is not None:
                out.append(rec)
        return out
