"""Generic fallback for hand-written loss prints in training scripts.

Reads lines such as ``step:20, loss:2.783203125``, ``[Rank 0] Loss: 9.4306``,
``[12,  1800] loss: 1.842``, ``Step 5 | loss 2.3``, ``iter 40: loss nan``,
``loss: tensor(2.31, device='cuda:0')``. Conservative by design (priority 95: any specific producer
that claims the line wins):
* the word ``loss`` must stand alone (not ``loss_scale``, ``loss scale: X``, ``LpLoss_error``, ``loss_cls``)
  and be followed directly by a number (``:``, ``=``, ``is`` or spaces between);
* the word before it qualifies it: ``val``/``valid``/``eval``/``test``/``dev`` -> EVAL_LOSS;
  ``avg``/``average``/``mean``/``epoch``/``best``/``final``/``min`` (end-of-epoch averages such as
  MindFormers' ``avg loss:``) and component losses (``nll loss``, ``lm loss``) are skipped;
* a step is reported only from a ``step``/``iter``/``iteration``/``global_step`` counter that is not
  ``N/M`` and not on a line that also names an epoch (then it is likely a within-epoch count);
  ``[epoch, batch]`` prefixes give no step; ``[Rank 0]`` is not a stream rank prefix.
"""

from __future__ import annotations

import re

from ...model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_LOSS_RE = re.compile(
    rf"(?=[lL])(?<![A-Za-z0-9.])(?:loss|Loss|LOSS)(?:[ \t]+is[ \t]+|[ \t]*[:=][ \t]*|[ \t]+)(?:(?:tensor\(|\[)[ \t]*)?"
    rf"(?P<v>{FLOAT})(?![\w.%])")
_QUAL_RE = re.compile(r"([A-Za-z]+)[ _/-]$")
_EVAL = {"val", "valid", "validation", "eval", "evaluation", "test", "dev"}
_TRAIN = {"train", "training", "total", "step", "batch", "running", "iter", "the"}
_STEP_RE = re.compile(r"\b(?:global_step|step|Step|STEP|iter|Iter|iteration|Iteration)\b\s*(?:[:=#]\s*)?(\d+)\b(?!\s*/)")
_EPOCH_RE = re.compile(r"\b[Ee]poch\b")
_EXTRA = ((LEARNING_RATE, re.compile(rf"\b(?:lr|learning[ _]rate)\s*[:=]\s*\[?({FLOAT})(?![\w.])")),
          (GRAD_NORM, re.compile(rf"\b(?:grad[ _]norm|gnorm)\s*[:=]\s*({FLOAT})(?![\w.])")))


class UserPrintParser(Parser):
    name = "user_print"
    priority = 95
    keywords = ("loss", "Loss", "LOSS")

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        text = block.text
        current: Record | None = None
        cur_end = -1
        for m in _LOSS_RE.finditer(text):
            start = m.start()
            q = _QUAL_RE.search(text, max(0, start - 24), start)
            qual = q.group(1).lower() if q else None
            if qual in _EVAL:
                metric = EVAL_LOSS
            elif qual is None or qual in _TRAIN:
                metric = LOSS
            else:
                continue
            if (v := to_float(m.group("v"))) is None:
                continue
            if current is None or start > cur_end:  # the first loss on this line
                end = text.find("\n", start)
                cur_end = len(text) if end < 0 else end
                line = text[block.line_start(start):cur_end]
                current = self.record(block, start)
                s = _STEP_RE.search(line)
                if s and (s.group(0).startswith("global") or not _EPOCH_RE.search(line)):
                    current.step = to_step(s.group(1))
                for extra, rx in _EXTRA:
                    if (x := rx.search(line)) and (xv := to_float(x.group(1))) is not None:
                        current.add(extra, xv)
                out.append(current)
            if all(mt != metric for mt, _, _ in current.values):  # one value per metric and line
                current.add(metric, v)
        return out
