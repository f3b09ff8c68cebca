"""TensorFlow 1 Estimator / MonitoredSession logs.

* ``ERROR:tensorflow:Model diverged with loss = NaN.`` and its absl form
  ``E1103 08:21:47.530912 139872204318528 basic_session_run_hooks.py:771] Model diverged with
  loss = NaN.`` -> one ``nonfinite_message`` (what="loss"); each worker prints one (the stream
  layer drops the copies of one line's text);
* ``INFO:tensorflow:loss = 0.6931472, step = 1`` (also ``I1103 ... ] loss = <f>, step = <i>
  (1.2 sec)``) -> ``loss`` with its step;
* ``Saving dict for global step <i>: ..., loss = <f>`` (evaluation) -> ``eval_loss``.

Traps: ``NaN`` is spelled in prose only in the divergence message, which has no step;
``global_step/sec`` lines are not losses.
"""

from __future__ import annotations

import re

from ...model import EVAL_LOSS, LOSS, NONFINITE_MESSAGE
from .base import FLOAT, Block, Parser, Record, to_float, to_step

_RE = re.compile(
    r"(?P<div>Model diverged with loss = (?:NaN|nan|inf|Inf))"
    rf"|(?<![\w.])loss = (?P<loss>{FLOAT}), step = (?P<step>\d+)"
    rf"|Saving dict for global step (?P<es>\d+):[^\n]{{0,2000}}?(?<![\w.])loss = (?P<eval>{FLOAT})"
)


class TFEstimatorParser(Parser):
    name = "tf_estimator"
    priority = 45
    keywords = ("loss = ",)

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _RE.finditer(block.text):
            pos = m.start()
            rec = self.record(block, pos)
            if m.group("div"):
                rec.add(NONFINITE_MESSAGE, 1.0, what="loss")
            elif m.group("loss") is not None:
                rec.step = to_step(m.group("step"))
                if (v := to_float(m.group("loss"))) is not None:
                    rec.add(LOSS, v)
            else:
                rec.step = to_step(m.group("es"))
                if (v := to_float(m.group("eval"))) is not None:
                    rec.add(EVAL_LOSS, v)
            if rec.values:
                out.append(rec)
        return out
