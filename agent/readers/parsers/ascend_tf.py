"""TensorFlow on Ascend NPU (npu_bridge ModelZoo hooks and test logs, precision_tool's callback).

Traps handled here:
* ModelZoo ``_LogSessionRunHook``: ``Find overflow in this step, skip apply gradients, loss scale
  value=X`` is an overflow (skipped step) plus a scale reading; ``Apply gradients, loss scale value=X``
  is only a reading;
* ``overflow_status_reduce_all: True`` means **no** overflow (it is ``reduce_all(status == 0)``);
  only ``False`` is an overflow. ``loss_scale is: <v>`` (or ``is : [v]``) is a reading; so is the
  TF1 README's ``>>> Current Loss Scale >>>  [v]``;
* precision_tool ``PrecisionTool: Train steps N, loss_scale=X / not_overflow_status=B``: ``B`` False is
  an overflow (of the previous step; the callback prints at batch begin);
* ModelZoo test lines with irregular spacing and a space before commas:
  ``epoch:1  step: 0 , loss:  0.0681 ,  time: 113.6311  acc: 1.0000`` -> loss with its step.
The TF C++ log lines around them (``<date> <time.us>: I <path>:<line>] ...``) are not read.
"""

from __future__ import annotations

import re

from ...model import LOSS, LOSS_SCALE, OVERFLOW
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_RE = re.compile(
    r"(?=[FAloPCe])"  # every alternative starts with one of these: positions that cannot match fail fast
    rf"(?:(?:(?P<find>Find overflow in this step, skip apply gradients, )|Apply gradients, )"
    rf"loss scale value\s*=\s*(?P<hook>{FLOAT})"
    rf"|loss_scale is\s*:\s*(?:\[\s*)?(?P<lsis>{FLOAT})"
    r"|overflow_status_reduce_all\s*:\s*(?:\[\s*)?(?P<reduce>True|False)\b"
    rf"|PrecisionTool: Train steps (?P<ptstep>\d+), loss_scale=(?P<ptscale>{FLOAT})"
    r"(?: / not_overflow_status=\[?\s*(?P<ptok>True|False))?"
    rf"|Current Loss Scale\s*>>>\s*(?:\[\s*)?(?P<cur>{FLOAT})"
    rf"|\bepoch[ \t]*:[ \t]*(?P<tepoch>\d+)[ \t]*(?:,[ \t]*)?step[ \t]*:[ \t]*(?P<tstep>\d+)[ \t]*,[ \t]*loss[ \t]*:[ \t]*"
    rf"(?P<tloss>{FLOAT})(?![\w.]))")


class AscendTFParser(Parser):
    name = "ascend_tf"
    priority = 40
    copies = False  # hook lines carry neither timestamp nor step: identical lines are real steps
    keywords = ("loss", "Loss", "overflow_status")

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            pos = m.start()
            rec = self.record(block, pos)
            g = m.groupdict()
            if g["hook"] is not None:
                if g["find"]:
                    rec.add(OVERFLOW, 1.0, variant="skip")
                scale = g["hook"]
            elif g["reduce"] is not None:
                if g["reduce"] == "False":
                    rec.add(OVERFLOW, 1.0, variant="flag")
                scale = None
            elif g["ptscale"] is not None:
                rec.step = to_step(g["ptstep"])
                if g["ptok"] == "False":
                    rec.add(OVERFLOW, 1.0, variant="flag")
                scale = g["ptscale"]
            elif g["tloss"] is not None:
                rec.step = to_step(g["tstep"])  # within the epoch: the epoch rides along (series.py)
                epoch = to_step(g["tepoch"])
                if (v := to_float(g["tloss"])) is not None and epoch is not None:
                    rec.add(LOSS, v, epoch=epoch)
                scale = None
            else:
                scale = g["lsis"] if g["lsis"] is not None else g["cur"]
            if scale is not None and (v := to_float(scale)) is not None:
                rec.add(LOSS_SCALE, v)
            if rec.values:
                out.append(rec)
        return out
