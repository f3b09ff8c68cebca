"""fairseq training logs: json, simple and pipe log formats, fp16 overflow notes.

Traps handled here:
* json format (``train_inner | {...}``): every value except epoch/update is a *string*; the object
  is read with ``json.loads`` (never eval) and a damaged object is skipped. ``valid | {...}`` gives
  ``valid_loss`` (an eval loss); ``train | {...}`` is the epoch summary: its ``train_loss`` is an
  average and is skipped, only its (last-value) ``train_loss_scale`` is kept.
* MoE keys such as ``overflow_expert1`` are capacity metrics, not fp16 overflows (never read).
* simple format (``| epoch 002:    300 / 1816 loss=..., loss_scale=0.031``) and json's ``round=4``
  print the scale rounded (0.031 for 0.03125). The printed value is kept unless it is exactly the
  rounding of the last scale an overflow note announced, or of exactly one power of two (fairseq's
  scales are powers of two); then the exact value is used (attr ``printed``), so rounding never
  looks like a scale change. ``0.000`` with nothing to match it to is not a scale and is dropped.
* pipe format (``| epoch 014 | loss 7.108 | ... | loss_scale 0.250``) is an epoch summary: no LOSS;
  ``| epoch 001 | valid on 'valid' subset | loss 9.4 |`` is an eval loss.
* overflow notes print only the new scale (``setting loss scale to: X``) -> OVERFLOW(reduce) +
  LOSS_SCALE(decrease=True); ``FloatingPointError: Minimum loss scale reached (X).`` ->
  OVERFLOW(min_scale) + LOSS_SCALE(X).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ...model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, OVERFLOW
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_RE = re.compile(
    rf"overflow detected,(?: ignoring gradient,)? setting loss scale to:?\s*(?P<note>{FLOAT})"
    rf"|Minimum loss scale reached \((?P<min>{FLOAT})\)"
    r"|\|\s*(?P<tag>train_inner|train|valid\w*)\s*\|\s*(?P<json>\{[^\n]*)"  # to the last "}" (below): linear
    r"|(?:^|\|)[ \t]*epoch[ \t]+\d+:[ \t]+\d+[ \t]*/[ \t]*\d+[ \t]+(?P<simple>\w+=[^\n]*)"
    r"|\|[ \t]*epoch[ \t]+\d+[ \t]*(?P<pipe>\|[^\n]*)", re.M)
_KV_RE = re.compile(r"(\w+)=([^,\s]+)")
_PIPE_RE = re.compile(r"\|\s*([a-z_]+)\s+([^|\s]+)")


class FairseqParser(Parser):
    name = "fairseq"
    priority = 40
    keywords = ("train_inner", "| train |", "| valid", "| epoch", "overflow detected", "Minimum loss scale")
    per_file = True  # remembers the last exact scale across blocks

    def __init__(self) -> None:
        self._scale: float | None = None  # last exact scale seen (rounded prints are matched to it)

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            pos = m.start()
            rec = self.record(block, pos)
            g = m.groupdict()
            if g["note"] is not None:
                if (v := to_float(g["note"])) is not None:
                    self._scale = v
                    rec.add(OVERFLOW, 1.0, variant="reduce", to=v)
                    rec.add(LOSS_SCALE, v, decrease=True)
            elif g["min"] is not None:
                if (v := to_float(g["min"])) is not None:
                    rec.add(OVERFLOW, 1.0, variant="min_scale")
                    rec.add(LOSS_SCALE, v)
            elif g["json"] is not None:
                if (close := g["json"].rfind("}")) >= 0:
                    self._json(rec, g["tag"], g["json"][:close + 1])
            elif g["simple"] is not None:
                self._fields(rec, dict(_KV_RE.findall(g["simple"])), summary=False, prefix="")
            else:
                valid = "valid on" in g["pipe"]  # "| epoch 001 | valid on 'valid' subset | loss 9.4 |"
                self._fields(rec, dict(_PIPE_RE.findall(g["pipe"])), summary=not valid, prefix="", eval_=valid)
            if rec.values:
                out.append(rec)
        return out

    def _json(self, rec: Record, tag: str, raw: str) -> None:
        try:
            obj = json.loads(raw)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        if tag == "train_inner":
            self._fields(rec, obj, summary=False, prefix="")
        elif tag == "train":
            self._fields(rec, obj, summary=True, prefix="train_")
        else:
            self._fields(rec, obj, summary=False, prefix=tag + "_", eval_=True)

    def _fields(self, rec: Record, f: dict[str, Any], *, summary: bool, prefix: str, eval_: bool = False) -> None:
        def get(key: str) -> float | None:
            raw = f.get(prefix + key)
            return None if raw is None or isinstance(raw, bool) else to_float(str(raw))

        if (step := get("num_updates")) is not None and math.isfinite(step):
            rec.step = to_step(step)
        if eval_:
            if (v := get("loss")) is not None:
                rec.add(EVAL_LOSS, v)
            return
        if not summary:
            for key, metric in (("loss", LOSS), ("gnorm", GRAD_NORM), ("lr", LEARNING_RATE)):
                if (v := get(key)) is not None:
                    rec.add(metric, v)
        raw = f.get(prefix + "loss_scale")
        if raw is not None and not isinstance(raw, bool) and (v := to_float(str(raw))) is not None:
            exact = self._exact(str(raw).strip(), v)
            if exact is not None:
                self._scale = exact
                rec.add(LOSS_SCALE, exact, **({"printed": v} if exact != v else {}))

    def _exact(self, text: str, v: float) -> float | None:
        """The scale a rounded print stands for (None: 0.000 with nothing to match it to)."""
        decimals = len(text.split(".", 1)[1]) if "." in text and "e" not in text.lower() else 0
        if decimals == 0 or not math.isfinite(v):
            return v
        same = lambda x: f"{x:.{decimals}f}" == f"{v:.{decimals}f}"  # noqa: E731
        if self._scale is not None and same(self._scale):
            return self._scale
        if v > 0:  # the one power of two that prints this way (two of them: ambiguous, keep the print)
            k = round(math.log2(v))
            powers = [p for p in (2.0 ** (k - 1), 2.0 ** k, 2.0 ** (k + 1)) if same(p)]
            if len(powers) == 1:
                return powers[0]
        return v if v > 0 else None
