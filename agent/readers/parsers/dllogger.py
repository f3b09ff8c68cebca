"""NVIDIA DLLogger stdout lines (DeepLearningExamples: BERT, ...).

``DLL <YYYY-MM-DD HH:MM:SS.ffffff> - Training Epoch: <e> Training Iteration: <i>  average_loss :
<f>  step_loss : <f>  learning_rate : <f> `` and ``DLL <ts> - PARAMETER loss_scale : <f> ``.
Traps handled here: ``key : value`` with spaces around the colon and a trailing space;
``step_loss`` is the training loss (``average_loss`` is a running mean, skipped; a bare ``loss``
is used when there is no ``step_loss``); loss scales far below 1 in scientific notation
(``7.450580596923828e-09``) are plain ``loss_scale`` samples (decreases come from comparing
them); non-numeric PARAMETER values (``model : bert``) are ignored. Step = the iteration.
"""

from __future__ import annotations

import re

from ...model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_RE = re.compile(r"\bDLL \d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)? - (?P<rest>[^\n]*)")
_STEP_RE = re.compile(r"Iteration:\s*(\d+)")
_EPOCH_RE = re.compile(r"Epoch:\s*(\d+)")
_PAIR_RE = re.compile(rf"(?<![\w.])(?P<key>[A-Za-z_][\w.]*) : (?P<val>{FLOAT})(?=\s|$)")
_METRICS = ((("step_loss", "loss"), LOSS), (("eval_loss", "val_loss", "validation_loss"), EVAL_LOSS),
            (("grad_norm",), GRAD_NORM), (("learning_rate", "lr"), LEARNING_RATE), (("loss_scale",), LOSS_SCALE))


class DLLoggerParser(Parser):
    name = "dllogger"
    priority = 40
    keywords = ("DLL ",)

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            rest = m.group("rest")
            pairs: dict[str, str] = {}
            for p in _PAIR_RE.finditer(rest):
                pairs.setdefault(p.group("key"), p.group("val"))
            if not pairs:
                continue
            pos = m.start()
            st = _STEP_RE.search(rest)
            rec = self.record(block, pos, to_step(st.group(1)) if st else None)
            ep = _EPOCH_RE.search(rest) if st else None  # iterations may count within the epoch
            epoch = to_step(ep.group(1)) if ep else None
            attrs = {"epoch": epoch} if epoch is not None else {}
            for keys, metric in _METRICS:
                raw = next((pairs[k] for k in keys if k in pairs), None)
                if raw is not None and (v := to_float(raw)) is not None:
                    rec.add(metric, v, **attrs)
            if rec.values:
                out.append(rec)
        return out
