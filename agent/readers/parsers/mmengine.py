"""OpenMMLab training logs: mmengine (xtuner, mmdet 3.x, mmpretrain) and mmcv v1 runners.

* mmengine: ``04/17 08:52:36 - mmengine - INFO - Epoch(train) [2][180/612]  lr: 1.4472e-04  eta:
  ...  loss: 1.9346  grad_norm: nan`` (two-space separated) and ``Iter(train) [ 50/80000] ...``;
* mmcv v1: ``<ts> - mmdet - INFO - Epoch [3][412/915]<TAB>lr: 2.500e-04, eta: ..., loss_cls: nan,
  ..., loss: nan[, grad_norm: <f>]`` (comma separated) and ``Iter [50/80000] ...``.

Traps handled here: only ``loss:`` is the total loss (``loss_cls``, ``decode.loss_ce`` ... are
parts); ``base_lr`` is not ``lr``; ``Epoch(val)`` lines are not training; the same record copied
by several handlers (``[ INFO ] Epoch [3]...``) starts each record at ``Epoch``/``Iter`` so the
stream layer recognises the copies. Step: the iteration for ``Iter`` lines; for ``Epoch`` lines
the global iteration ``(epoch - 1) * iters_per_epoch + i`` (the ``[i/n]`` counter is per epoch).
"""

from __future__ import annotations

import re

from ...model import GRAD_NORM, LEARNING_RATE, LOSS
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_RE = re.compile(
    r"\b(?:Epoch(?:\(train\))?\s*\[\s*(?P<ep>\d+)\]\s*\[\s*(?P<i>\d+)/\s*(?P<n>\d+)\]"
    r"|Iter(?:\(train\))?\s*\[\s*(?P<it>\d+)/\s*\d+\])"
    r"(?P<rest>[^\n]*)"
)
_FIELD_RE = re.compile(rf"(?<![\w.])(?P<key>loss|lr|grad_norm):\s*(?P<val>{FLOAT})(?=[,\s]|$)")
_METRICS = {"loss": LOSS, "grad_norm": GRAD_NORM, "lr": LEARNING_RATE}


class MMEngineParser(Parser):
    name = "mmengine"
    priority = 40
    keywords = ("Epoch(train)", "Iter(train)", "Epoch [", "Iter [")

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            fields: dict[str, str] = {}
            for f in _FIELD_RE.finditer(m.group("rest")):
                fields.setdefault(f.group("key"), f.group("val"))
            if "loss" not in fields and "lr" not in fields:
                continue  # a progress message, not a metrics line
            if m.group("it") is not None:
                step = to_step(m.group("it"))
            else:
                ep, n, i = to_step(m.group("ep")), to_step(m.group("n")), to_step(m.group("i"))
                step = to_step(float((ep - 1) * n + i)) if None not in (ep, n, i) else None
            pos = m.start()
            rec = self.record(block, pos, step)
            for key, metric in _METRICS.items():
                if key in fields and (v := to_float(fields[key])) is not None:
                    rec.add(metric, v)
            out.append(rec)
        return out
