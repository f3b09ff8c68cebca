"""JSON-lines metric logs: a line that is one flat JSON object with step/loss-like keys.

Traps handled here:
* only whole-line JSON objects (``{"step": 3, "loss": 2.1}``) are read, with ``json.loads`` (Python
  dict reprs such as HF's ``{'loss': ...}`` are not JSON and are left to their own parser); a damaged
  line is skipped;
* values may be numbers or strings (``"2.31"``, ``"nan"``); Python's json writes NaN/Infinity bare;
  booleans are never numbers;
* ``eval``/``val``/``valid``/``test`` losses are EVAL_LOSS, never training loss; ``train_loss`` next to
  ``train_runtime`` is the HF end-of-run summary and is skipped;
* a line needs a loss, eval loss, grad norm or loss scale (or an lr together with a step) so that a
  config dump that happens to hold ``lr`` is not read as a sample.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ...model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE
from .base import Block, Parser, Record, to_float, to_step

_LINE_RE = re.compile(r"^[ \t]*(\{[ \t]*\"[^\n]*\})[ \t]*\r?$", re.M)  # {"key": ...}, not {'key': ...}
_STEP_KEYS = ("step", "global_step", "train/global_step", "iteration", "iter", "num_updates")
_KEYS = (
    (LOSS, ("loss", "train_loss", "train/loss", "training_loss")),
    (EVAL_LOSS, ("eval_loss", "eval/loss", "val_loss", "val/loss", "valid_loss", "valid/loss",
                 "validation_loss", "test_loss")),
    (GRAD_NORM, ("grad_norm", "gnorm", "train/grad_norm", "grad-norm")),
    (LOSS_SCALE, ("loss_scale", "scale", "train/loss_scale")),
    (LEARNING_RATE, ("lr", "learning_rate", "train/learning_rate")),
)


_INT_MAX = 1 << 1023


def _num(raw: Any) -> float | None:
    if isinstance(raw, bool) or raw is None or isinstance(raw, (dict, list)):
        return None
    if isinstance(raw, float):
        return raw
    if isinstance(raw, int):  # JSON integers have no size limit; beyond float's range: none
        return float(raw) if -_INT_MAX <= raw <= _INT_MAX else None
    return to_float(str(raw))


class JsonLinesParser(Parser):
    name = "jsonl"
    priority = 92
    keywords = ("{",)

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _LINE_RE.finditer(block.text):
            try:
                obj = json.loads(m.group(1))
            except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
                continue
            if not isinstance(obj, dict):
                continue
            pos = m.start(1)
            rec = Record(line=block.line_of(pos), pos=pos, producer=self.name)
            for key in _STEP_KEYS:
                if (v := _num(obj.get(key))) is not None and math.isfinite(v):
                    rec.step = to_step(v)
                    break
            summary = "train_runtime" in obj
            for metric, keys in _KEYS:
                for key in keys:
                    if summary and key == "train_loss":
                        continue
                    if (v := _num(obj.get(key))) is not None:
                        rec.add(metric, v)
                        break
            metrics = {mt for mt, _, _ in rec.values}
            if metrics - {LEARNING_RATE} or (metrics and rec.step is not None):
                rec.log_time = block.log_time_at(pos)
                out.append(rec)
        return out
