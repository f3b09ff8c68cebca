"""PyTorch Lightning: metrics in the tqdm progress-bar postfix.

``Epoch 1:  61%|█████▌| 4117/6730 [03:18<02:05, 20.79it/s, v_num=3, learning_rate_step=0.0002,
train_loss_step=nan.0]``. Traps handled here: NaN printed ``nan.0``; the bar wraps onto a second
line (the postfix is read wherever the ``it/s,`` part landed) and the closing ``]`` may be
missing; many ``\\r`` frames on one line (one record per frame); ``train_loss_epoch`` is an epoch
average and ``val_loss`` repeats on every frame after validation (both skipped). Only postfixes
that look like Lightning's (``v_num=`` or a ``*_step=`` key) are read, so a plain tqdm postfix
(``step_loss=nan``) is left to other parsers. The bar counter is within the epoch: no step.

With ``rich`` installed Lightning draws a ``RichProgressBar``; when stdout is not a terminal rich
writes only its last frame, ``Epoch 0/0  ━━━━ 50/50 0:00:06 • 0:00:00 9.21it/s v_num: 0``, the
metrics column wrapped onto the next, indented lines (``train_loss_step:`` then ``nan``). The
frame and its continuation lines are read as one record (``key: value`` pairs, ``.3f`` values).
"""

from __future__ import annotations

import re

from ...model import GRAD_NORM, LEARNING_RATE, LOSS
from .base import FLOAT, Block, Parser, Record, line_spans, merge_spans, to_float

_POSTFIX_RE = re.compile(r"(?:it/s|s/it),\s*(?P<post>[A-Za-z_][\w./-]*=[^\]\n\r]*)")
_PAIR_RE = re.compile(rf"(?:^|,)\s*(?P<key>[A-Za-z_][\w./-]*)=(?P<val>{FLOAT})(?=\s*(?:,|$))")
# rich's last frame: the epoch column, the bar, counter, times and speed, then the metrics column,
# wrapped onto indented continuation lines
# (anchored at the line's start, a launcher's prefix allowed: one linear scan per line, whatever it holds)
_RICH_RE = re.compile(r"^[^\n\r]{0,40}?Epoch \d{1,9}/\d{1,9} [^\n\r]*?\d/\d+ [^\n\r]*?it/s"
                      r"(?P<post>[^\n\r]*)(?P<cont>(?:\n[ \t]{8,}\S[^\n\r]*)*)", re.M)
_RICH_PAIR_RE = re.compile(rf"(?P<key>[A-Za-z_][\w./-]*):\s+(?P<val>{FLOAT})(?=\s|$)")
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
    keywords = ("v_num=", "_step=", "v_num:", "_step:")

    def parse(self, block: Block) -> list[Record]:
        return self._parse(block)[0]

    def parse_spans(self, block: Block) -> tuple[list[Record], list[tuple[int, int]] | None]:
        records, rich = self._parse(block)
        if not rich:
            return records, None
        return records, merge_spans(line_spans(block.text, records) + rich)

    def _parse(self, block: Block) -> tuple[list[Record], list[tuple[int, int]]]:
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
            self._values(rec, pairs)
            if rec.values:
                out.append(rec)
        rich: list[tuple[int, int]] = []  # (start, end) of each rich frame with its continuation lines
        if "it/s" in block.text and ": " in block.text:
            for m in _RICH_RE.finditer(block.text):
                metrics = " ".join((m.group("post") + m.group("cont")).split())
                pairs = {p.group("key"): p.group("val") for p in _RICH_PAIR_RE.finditer(metrics)}
                if "v_num" not in pairs and not any(k.endswith("_step") for k in pairs):
                    continue
                rec = self.record(block, m.start())
                self._values(rec, pairs)
                if rec.values:
                    out.append(rec)
                    rich.append((block.line_start(m.start()), m.end()))
            if rich:
                out.sort(key=lambda r: r.pos)
        return out, rich

    @staticmethod
    def _values(rec: Record, pairs: dict[str, str]) -> None:
        for keys, metric in ((_LOSS_KEYS, LOSS), (_GN_KEYS, GRAD_NORM), (_LR_KEYS, LEARNING_RATE)):
            if (v := _first(pairs, keys)) is not None:
                rec.add(metric, v)
