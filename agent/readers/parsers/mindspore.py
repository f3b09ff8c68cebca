"""MindSpore family: LossMonitor, ModelZoo ``outputs are (...)`` triples, mindone, MindFormers, mindyolo.

Traps handled here:
* the loss may be a plain float or a Tensor repr, new (``Tensor(shape=[], dtype=Float32, value= 0.66)``)
  or old (``Tensor(shape=[1], dtype=Float32, [ 1.0821701e+01])``), NaN printed as ``nan``;
* LossMonitor's ``step`` counts within the epoch, so no step is reported for it (nor for MindFormers'
  ``step:[ 8/ 250]``, mindone or mindyolo); the ModelZoo triple prints ``cur_step_num`` (global);
* the triple is (loss, overflow flag, loss scale): ``True`` is an overflow (the step is skipped);
* MindFormers ``loss:[3.117/3.117]`` is ``[current/avg]`` (current is taken), ``overflow cond: False`` is
  **not** an overflow, the scale is float32-rounded (``134217730.0`` for 2^27; kept as printed), and
  ``epoch_end: ... avg loss:`` is an end-of-epoch average (never read);
* mindyolo ``overflow, still update, loss scale adjust to X``: overflow whose step is *not* skipped;
  the same value may repeat; its ``Epoch e/E, Step s/S, imgsize ..., loss: X`` line needs ``imgsize``
  (a generic ``Epoch 3/10, Step 5/9, loss:`` print is left to the fallback parser);
* ``Invalid loss, terminating training`` / ``loss is NAN or INF``: a non-finite-loss message.
"""

from __future__ import annotations

import re

from ...model import GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, OVERFLOW
from .base import FLOAT, Block, Parser, Record, to_float, to_step


def _tensor(group: str, dtype: str = r"\w+", value: str = FLOAT) -> str:
    """A value printed bare or as a MindSpore Tensor repr (either vintage)."""
    return (rf"(?:Tensor\(shape=\[[^\]]*\],\s*dtype={dtype},\s*(?:value=\s*)?)?"
            rf"\[?\s*(?P<{group}>{value})\s*\]?\)?")


_RE = re.compile(
    r"(?=[esoEIl])(?:"  # the first letters of the alternatives: other positions fail fast
    rf"epoch:\s*\d+,?\s+step:\s*\d+,\s*(?:loss is\s+(?!NAN or INF){_tensor('lm')}"
    rf"|lr:\s*(?P<dlr>{FLOAT}),\s*loss:\s*(?P<dloss>{FLOAT})(?:,\s*loss scale:\s*(?P<dscale>{FLOAT}))?)"
    rf"|step:\s*(?P<ostep>\d+),\s*outputs are \(\s*{_tensor('oloss')},\s*"
    rf"{_tensor('oflag', 'Bool', 'True|False')}(?:,\s*{_tensor('oscale')})?"
    rf"|overflow detected in epoch \d+ step \d+"
    rf"|Epoch:\[\s*\d+/\s*\d+\],\s*step:\[\s*\d+/\s*\d+\],\s*loss:\s*(?:\[\s*)?(?P<mf>{FLOAT})(?P<mfrest>[^\n]*)"
    rf"|overflow, still update, loss scale adjust to\s*(?P<yscale>{FLOAT})"
    rf"|Epoch \d+/\d+, Step \d+/\d+, imgsize[^\n]{{0,400}}?\bloss:\s*(?P<yloss>{FLOAT})(?P<yrest>[^\n]*)"
    r"|(?P<bad>Invalid loss, terminating training|loss is NAN or INF))")
_MF_LR = re.compile(rf"\blr:\s*(?:\[\s*)?({FLOAT})")
_MF_OVF = re.compile(r"overflow cond:\s*(True|False)")
_MF_SCALE = re.compile(rf"loss_scale:\s*(?:\[\s*)?({FLOAT})")
_MF_GNORM = re.compile(rf"global_norm:\s*(?:\[\s*)?({FLOAT})")
_Y_LR = re.compile(rf"cur_lr:\s*({FLOAT})")


def _add(rec: Record, metric: str, raw: str | None, **attrs) -> None:
    if raw is not None and (v := to_float(raw)) is not None:
        rec.add(metric, v, **attrs)


def _first(rx: re.Pattern, text: str) -> str | None:
    m = rx.search(text)
    return m.group(1) if m else None


class MindSporeParser(Parser):
    name = "mindspore"
    priority = 40
    keywords = ("loss is", "outputs are", "Epoch:[", "loss scale", "overflow", "loss:", "Invalid loss")

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            pos = m.start()
            rec = self.record(block, pos)
            g = m.groupdict()
            if g["lm"] is not None:
                _add(rec, LOSS, g["lm"])
            elif g["dloss"] is not None:
                _add(rec, LOSS, g["dloss"])
                _add(rec, LEARNING_RATE, g["dlr"])
                _add(rec, LOSS_SCALE, g["dscale"])
            elif g["oloss"] is not None:
                rec.step = to_step(g["ostep"])
                _add(rec, LOSS, g["oloss"])
                if g["oflag"] == "True":
                    rec.add(OVERFLOW, 1.0, variant="flag")
                _add(rec, LOSS_SCALE, g["oscale"])
            elif g["mf"] is not None:
                rest = g["mfrest"]
                _add(rec, LOSS, g["mf"])
                _add(rec, LEARNING_RATE, _first(_MF_LR, rest))
                _add(rec, GRAD_NORM, _first(_MF_GNORM, rest))
                if _first(_MF_OVF, rest) == "True":
                    rec.add(OVERFLOW, 1.0, variant="flag")
                _add(rec, LOSS_SCALE, _first(_MF_SCALE, rest))
            elif g["yscale"] is not None:
                rec.add(OVERFLOW, 1.0, variant="not_skipped")
                _add(rec, LOSS_SCALE, g["yscale"])
            elif g["yloss"] is not None:
                _add(rec, LOSS, g["yloss"])
                _add(rec, LEARNING_RATE, _first(_Y_LR, g["yrest"]))
            elif g["bad"] is not None:
                rec.add(NONFINITE_MESSAGE, 1.0, what="loss")
            else:  # mindone "overflow detected in epoch e step s."
                rec.add(OVERFLOW, 1.0, variant="flag")
            if rec.values:
                out.append(rec)
        return out
