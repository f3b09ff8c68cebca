"""Megatron-LM and Megatron-DeepSpeed iteration and validation lines.

One pipe-separated line per log interval. Traps handled here: ``lm loss``/``grad norm`` are
absent when the whole interval was skipped; ``number of nan iterations: 0`` is a counter, not a
NaN; the validation line's ``lm loss value`` is not a training loss.

Speed: catching up on a backlog means millions of these lines, so a line of the usual shape is
read by one C-level regex match (its fields come out as groups); any other shape takes the
general per-field path, which reads the same values (see ``_SHAPE`` for why they agree).
"""

from __future__ import annotations

import re

from ...model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, SKIPPED_INTERVAL
from .base import Block, Parser, Record, to_float

_VALID_RE = re.compile(r"validation loss at iteration\s+(\d+)\s*\|([^\n]*)")
_ITER_FIELDS = (("lm loss:", LOSS), ("loss scale:", LOSS_SCALE), ("grad norm:", GRAD_NORM),
                ("learning rate:", LEARNING_RATE))
_NAN_ATTRS = (("what", "nan_iterations"),)

# The fields read, in the order Megatron prints them.
_KNOWN = ("learning rate", "lm loss", "loss scale", "grad norm", "number of skipped iterations",
          "number of nan iterations")
# Other fields Megatron-LM and Megatron-DeepSpeed print between them. None may end with a known
# name ("decoupled learning rate" would): a line with such a field goes the general way.
_OTHERS = ("consumed samples", "consumed tokens", "elapsed time per iteration (ms)",
           "throughput per GPU (TFLOP/s/GPU)", "global batch size", "num zeros", "params norm",
           "actual seqlen", "samples per second", "TFLOPs", "curriculum seqlen", "sop loss",
           "mtp_1 loss", "load_balancing_loss", "lm loss PPL", "skipped samples")
assert not any(o.endswith(k) for o in _OTHERS for k in _KNOWN)

# The usual shape of the rest of an iteration line: ``name: value |`` segments, every name from
# the two lists above, each known one at most once and in Megatron's order, no value holding a
# colon. Then the first occurrence of ``"lm loss:"`` (what the general path looks for) can only be
# the captured ``lm loss`` segment, and its value up to the next ``|`` is the captured group: both
# paths read the same numbers. Possessive quantifiers: a segment can be read one way only, so a
# line of another shape fails fast, and the second branch hands its rest to the general path.
_OTHER = r"[ \t]*+(?:" + "|".join(map(re.escape, _OTHERS)) + r"):[^|:\n]*+\|"
_SHAPE = (f"(?:{_OTHER})*+" + "".join(f"(?:[ \\t]*+{k}:([^|:\\n]*+)\\|)?+(?:{_OTHER})*+" for k in _KNOWN)
          + r"[^|:\n]*+(?![^\n])")
# "iteration" not preceded by a word character (as \b, but a leading literal lets re skip ahead
# fast); the stamp of Megatron's usual `` [YYYY-MM-DD HH:MM:SS] iteration`` prefix is captured
_ITER_RE = re.compile(r"iteration(?:(?<=\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)\] iteration)|(?<!\witeration))"
                      r"\s+(\d+)\s*/\s*(\d+)\s*\|" f"(?:{_SHAPE}|([^\\n]*))")
_STAMPED = len("[YYYY-MM-DD HH:MM:SS] ")


def _field(rest: str, key: str) -> float | None:
    """The number after ``key`` up to the next ``|`` (str.find: far cheaper than a regex per field)."""
    i = rest.find(key)
    if i < 0:
        return None
    j = rest.find("|", i)
    return to_float(rest[i + len(key):j if j >= 0 else len(rest)].strip())


def _general(rest: str) -> list[tuple[str, float, tuple]] | None:
    """Values of an iteration line of any shape; None when it is not a training line."""
    if "loss scale:" not in rest and "lm loss:" not in rest and "learning rate:" not in rest:
        return None  # some other "iteration N/M |" text
    values = [(metric, v, ()) for key, metric in _ITER_FIELDS if (v := _field(rest, key)) is not None]
    if v := _field(rest, "number of skipped iterations:"):
        values.append((SKIPPED_INTERVAL, v, ()))
    if v := _field(rest, "number of nan iterations:"):
        values.append((NONFINITE_MESSAGE, v, _NAN_ATTRS))
    return values


def _num(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)  # float() itself ignores surrounding blanks, as .strip() would
    except ValueError:
        return to_float(text.strip())


def _shaped(lr: str | None, loss: str | None, scale: str | None, gnorm: str | None,
            skipped: str | None, nans: str | None) -> list[tuple[str, float, tuple]]:
    """``_general``'s values from the fields of a line of the usual shape."""
    try:  # the common case: all four present and plain numbers
        values = [(LOSS, float(loss), ()), (LOSS_SCALE, float(scale), ()),  # type: ignore[arg-type]
                  (GRAD_NORM, float(gnorm), ()), (LEARNING_RATE, float(lr), ())]  # type: ignore[arg-type]
    except (TypeError, ValueError):
        values = [(metric, v, ()) for metric, text in ((LOSS, loss), (LOSS_SCALE, scale), (GRAD_NORM, gnorm),
                                                      (LEARNING_RATE, lr)) if (v := _num(text)) is not None]
    # counters are mostly 0: strip(" 0") leaves nothing exactly when _num would give 0 or None
    if skipped is not None and skipped.strip(" 0") and (v := _num(skipped)):
        values.append((SKIPPED_INTERVAL, v, ()))
    if nans is not None and nans.strip(" 0") and (v := _num(nans)):
        values.append((NONFINITE_MESSAGE, v, _NAN_ATTRS))
    return values


class MegatronParser(Parser):
    name = "megatron"
    priority = 10
    keywords = ("iteration",)

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        text, name, new = block.text, self.name, block.record
        for m in _ITER_RE.finditer(text):
            stamp, step, _total, lr, loss, scale, gnorm, skipped, nans, rest = m.groups()
            if rest is None:
                try:  # inline for the common case: all four present and plain numbers, counters 0
                    values = [(LOSS, float(loss), ()), (LOSS_SCALE, float(scale), ()),  # type: ignore[arg-type]
                              (GRAD_NORM, float(gnorm), ()), (LEARNING_RATE, float(lr), ())]  # type: ignore[arg-type]
                    if skipped.strip(" 0") or nans.strip(" 0"):  # type: ignore[union-attr]
                        values = _shaped(lr, loss, scale, gnorm, skipped, nans)
                except (TypeError, ValueError, AttributeError):
                    if lr is None and loss is None and scale is None:
                        continue  # some other "iteration N/M |" text
                    values = _shaped(lr, loss, scale, gnorm, skipped, nans)
            elif (values := _general(rest)) is None:
                continue
            pos = m.start()
            if stamp is not None:  # the stamp counts only as the first thing on its line
                bracket = pos - _STAMPED
                start = text.rfind("\n", 0, bracket) + 1
                if pos >= start + 120 or (bracket != start and not text[start:bracket].isspace()):
                    stamp = None
            out.append(new(pos, int(step), name, values, stamp))
        if "validation loss" in text:
            for m in _VALID_RE.finditer(text):
                if (v := _field(m.group(2), "lm loss value:")) is None:
                    continue
                pos = m.start()
                rec = self.record(block, pos, int(m.group(1)))
                rec.add(EVAL_LOSS, v)
                out.append(rec)
            out.sort(key=lambda r: r.pos)
        return out
