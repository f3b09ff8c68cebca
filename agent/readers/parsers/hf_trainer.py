"""Hugging Face Transformers Trainer: the Python dict repr printed every ``logging_steps``.

``{'loss': <f>, 'grad_norm': <f|nan|inf>, 'learning_rate': <f>, 'epoch': <f>}`` and eval dicts
(``eval_loss``). Traps handled here:

* the dict is found anywhere in a line: glued after a tqdm frame (``...it/s]{'loss': ...}``),
  after many clearing spaces, behind a ``Step:     12`` wrapper (its step is used), a
  llamafactory ``... >> `` prefix, a ``> `` quote or indentation; right padding is harmless;
* a fragment whose opening ``{`` was overwritten by a bar (``7894737e-05, 'epoch': 0.44}``) is
  skipped, not mis-read; a dict cut before its ``}`` keeps only the pairs followed by a comma,
  so a value truncated by the bar (``'eval_recall_macro': 0.100%|███``) is never read;
* the end summary ``{'train_runtime': ..., 'train_loss': ...}`` is not a training loss (skipped);
* values are Python reprs (``'loss': 0.6931``, ``nan``, ``inf``) in transformers 4.x, and quoted
  ``f"{v:.4g}"`` strings since 5.x (``'loss': '8.984'``, ``'9.53e+05'``, ``'nan'``, ``'inf'``): both read;
* ``'loss': 0.0`` is a printed (finite) value; where the grad norm beside it is NaN/Inf it is the
  ``logging_nan_inf_filter``'s stand-in for a NaN loss (detectors/nonfinite.py judges that pair);
* nothing is ``eval``-ed: pairs are read with a regex; ``epoch`` is not exported.
"""

from __future__ import annotations

import re

from ...model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS
from .base import FLOAT, Block, Parser, Record, to_float, to_step

# A dict that opens with a quoted key; the body runs to its "}" or to the end of the line/frame.
_DICT_RE = re.compile(r"(?:\bStep:\s*(?P<step>\d+)\s*)?\{(?P<body>'[A-Za-z_][^'\n\r]*'\s*:[^\n\r{}]*)(?P<close>\})?")
_PAIR_RE = re.compile(rf"'(?P<key>[A-Za-z_][\w/]*)'\s*:\s*(?:(?P<val>{FLOAT})|'(?P<qval>{FLOAT}|\d+/\d+)')(?=\s*[,}}])")
_METRICS = {"loss": LOSS, "eval_loss": EVAL_LOSS, "grad_norm": GRAD_NORM, "learning_rate": LEARNING_RATE}
_STEP_KEYS = ("global_step/max_steps", "global_step", "step")  # wrappers (ms-swift, ...) that print it


class HFTrainerParser(Parser):
    name = "hf_trainer"
    priority = 40
    keywords = ("{'",)

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        for m in _DICT_RE.finditer(block.text):
            body = m.group("body") + ("}" if m.group("close") else "")
            pairs = {p.group("key"): p.group("val") or p.group("qval") for p in _PAIR_RE.finditer(body)}
            if not any(k in pairs for k in _METRICS):
                continue  # summary dicts, configs, other dicts
            pos = m.start()
            step = to_step(m.group("step")) if m.group("step") else None
            if step is None:
                for key in _STEP_KEYS:
                    raw = pairs.get(key, "").split("/")[0]
                    if raw.isdigit():
                        step = to_step(raw)
                        break
            rec = self.record(block, pos, step)
            for key, metric in _METRICS.items():
                raw = pairs.get(key)
                if raw is not None and (v := to_float(raw)) is not None:
                    rec.add(metric, v)
            if rec.values:
                out.append(rec)
        return out
