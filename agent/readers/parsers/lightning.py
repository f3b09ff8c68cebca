"""PyTorch Lightning: metrics in the tqdm progress-bar postfix.

``Epoch 1:  61%|█████▌| 4117/6730 [03:18<02:05, 20.79it/s, v_num=3, learning_rate_step=0.0002,
train_loss_step=nan.0]``. Traps handled here: NaN printed ``nan.0``; the bar wraps onto a second
line (the postfix is read wherever the ``it/s,`` part landed) and the closing ``]`` may be
missing; many ``\\r`` frames on one line (one record per frame); ``train_loss_epoch`` is an epoch
average and ``val_loss`` repeats on every frame after validation (both skipped). Only postfixes
that look like Lightning's (``v_num=`` or a ``*_step=`` key) are read, so a plain tqdm postfix
(``step_loss=nan``) is left to other parsers. The bar counter is within the epoch: no step.
"""

from __future__ import annotations

import re

from ...model import GRAD_NORM, LEARNING_RATE, LOSS
from .base import FLOAT, Block, Parser, Record, to_float

_POSTFIX_RE = re.compile(r"(?:it/s|s/it),\s*(?P<post>[A-Za-z_][\w./-]*=[^\]\n\r]*)")
_PAIR_RE = re.compile(rf"(?:^|,)\s*(?P<key>[A-Za-z_][\w./-]*)=(?P<val>{FLOAT})(?=\s*(?:,|$))")
_LOSS_KEYS = ("train_loss_step", "train_loss", "loss_step", "loss")
_LR_KEYS = ("learning_rate_step", "learning_rate", "lr_step", "lr")
_GN_KEYS = ("grad_norm_step", "grad_norm")


def _first(pairs: dict[str, str], keys: tuple[str, ...]) -> float | None:
    for k in keys:
        if k in pairs and (v := to_float(pairs[k])) is not None:
            return v
    return None


class LightningParser(Parser):
    name = "lightning"
    priority = 50
    keywords = ("v_num=", "_step=")

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        where: dict[int, tuple[str | None, float | None]] = {}  # per line: a \r line holds many frames
        for m in _POSTFIX_RE.finditer(block.text):
            post = m.group("post").rstrip()
            pairs = {p.group("key"): p.group("val") for p in _PAIR_RE.finditer(post)}
            if "v_num" not in post and not any(k.endswith("_step") for k in pairs):
                continue
            pos = m.start()
            line = block.line_of(pos)
            if line not in where:
                where[line] = (block.rank_at(pos), block.log_time_at(pos))
            rank, log_time = where[line]
            rec = Record(line=line, pos=pos, log_time=log_time, rank=rank, producer=self.name)
            for keys, metric in ((_LOSS_KEYS, LOSS), (_GN_KEYS, GRAD_NORM), (_LR_KEYS, LEARNING_RATE)):
                if (v := _first(pairs, keys)) is not None:
                    rec.add(metric, v)
            if rec.values:
                out.append(rec)
        return out
