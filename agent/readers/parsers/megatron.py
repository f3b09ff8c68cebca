"""Megatron-LM and Megatron-DeepSpeed iteration and validation lines.

One pipe-separated line per log interval. Traps handled here: ``lm loss``/``grad norm`` are
absent when the whole interval was skipped; ``number of nan iterations: 0`` is a counter, not a
NaN; the validation line's ``lm loss value`` is not a training loss.

Speed: catching up on a backlog means millions of these lines, so a line of the usual shape is
read by one C-level regex match (its fields come out as groups); any other shape takes the
general per-field path, which reads the same values (see ``_SHAPE`` for why they agree). Faster
still, a block's lines of one layout (the same field names in the same order, as Megatron prints
them: one space, an optional stamp, then ``iteration``) are read by a regex made for that layout
(``_layout_re``): literal names instead of alternatives, no look-behind at every ``iteration`` of
a line. It is a special case of ``_SHAPE``, so it reads what the general regex would; lines it
does not take are left to the general regex (see ``MegatronParser.parse_spans``).
"""

from __future__ import annotations

import re
from operator import attrgetter

from ...model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, SKIPPED_INTERVAL
from .base import _TS_CACHE, Block, Parser, Record, line_spans, merge_spans, minute_seconds, to_float, to_step

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
_BY_POS = attrgetter("pos")


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


# A layout regex starts at the newline before its line (the block is searched with a newline put
# in front): the one space Megatron prints, then ``[stamp] `` (minute and seconds apart: minutes
# are cached) or nothing, then the head and the fields as ``_ITER_RE`` reads them, but with the
# spaces Megatron prints where ``_ITER_RE`` takes any blanks, and ASCII digits where it takes any
# ``\d`` (fewer steps for the regex engine, and ``iteration`` at a known place; other lines go the
# general way). Such a stamp counts, as ``_general`` counts it: only blanks before it, and
# ``iteration`` within 120 characters of the line start.
_LAYOUT_HEAD = (r"\n (?:\[([0-9]{4}-[0-9][0-9]-[0-9][0-9][ T][0-9][0-9]:[0-9][0-9]):([0-9][0-9])\] )?"
                r"iteration +([0-9]++)/ *+[0-9]++ \|")
_STAMPED_AT = len(" [YYYY-MM-DD HH:MM:SS] ")  # where ``iteration`` starts on a layout line with a stamp
_ABSENT = r"(?:()(?!))?"  # a group that never takes part: a field the layout lacks reads as None
_NAMES = frozenset(_KNOWN + _OTHERS)
_UNSET = object()


_SECONDS = {f"{i:02d}": i for i in range(100)}  # a stamp's seconds: a lookup is far cheaper than int()
_LAYOUTS: dict[tuple[str, ...], re.Pattern[str] | None] = {}
_LAYOUTS_MAX = 256


def _layout_re(names: tuple[str, ...]) -> re.Pattern[str] | None:
    """The regex for iteration lines with exactly these segment names; None for a layout
    ``_SHAPE`` would not take (an unknown name, a known one repeated or out of order). Groups:
    minute, seconds, step, then the six ``_KNOWN`` fields in their order whether present or not
    (the two counters only when not blanks and zeros)."""
    got = _LAYOUTS.get(names)
    if got is not None or names in _LAYOUTS:
        return got
    pieces, k = [_LAYOUT_HEAD], 0
    for n in names:
        if n not in _NAMES:
            break
        if n in _KNOWN:
            i = _KNOWN.index(n)
            if i < k:
                break
            pieces.extend([_ABSENT] * (i - k))
            k = i + 1
            counter = n.startswith("number of")  # a counter of blanks and zeros reads as absent
            pieces.append(f" {re.escape(n)}:" + ("(?:[ 0]*+\\||([^|:\\n]*+)\\|)" if counter else "([^|:\\n]*+)\\|"))
        else:
            pieces.append(f" {re.escape(n)}:[^|:\\n]*+\\|")
    else:
        pieces.extend([_ABSENT] * (len(_KNOWN) - k))
        pieces.append(r"[^|:\n]*+(?![^\n])")
        got = re.compile("".join(pieces))
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        _LAYOUTS.clear()
    _LAYOUTS[names] = got
    return got


def _first_layout(text: str) -> re.Pattern[str] | None:
    """The layout regex for the first line of the usual shape in ``text`` (among its first few
    iteration matches), if any."""
    for _, m in zip(range(4), _ITER_RE.finditer(text)):
        if m.group(10) is None:  # the usual shape
            bar = text.index("|", m.end(3))
            segs = text[bar + 1:m.end()].split("|")[:-1]
            return _layout_re(tuple(seg.partition(":")[0].lstrip(" \t") for seg in segs))
    return None


class MegatronParser(Parser):
    name = "megatron"
    priority = 10
    keywords = ("iteration",)

    def parse(self, block: Block) -> list[Record]:
        return self.parse_spans(block)[0]

    def parse_spans(self, block: Block) -> tuple[list[Record], list[tuple[int, int]] | None]:
        """Lines of the block's usual layout by its layout regex; then the general regex and
        the validation regex over the text between them, where it holds ``iteration`` (no
        general or validation match can reach into such a line: after its leading blanks comes
        ``[`` or ``iteration``, never the digits, ``/`` or ``|`` of a head that ran over a line
        end, and its fields cannot hold ``lm loss value:``)."""
        text = block.text
        out: list[Record] = []
        spans: list[tuple[int, int]] = []
        extra: list[Record] = []
        layout = _first_layout(text)
        if layout is None:
            self._others(block, 0, len(text), extra)
        else:
            self._layout(block, layout, out, spans)
            gap = 0
            for start, end in spans:
                if text.find("iteration", gap, start) >= 0:
                    self._others(block, gap, start, extra)
                gap = end
            self._others(block, gap, len(text), extra)
        if extra:
            spans = merge_spans(spans + line_spans(text, extra))
            out.extend(extra)
            out.sort(key=_BY_POS)
        return out, spans

    def _layout(self, block: Block, regex: re.Pattern[str], out: list[Record],
                spans: list[tuple[int, int]]) -> None:
        """Records of the lines ``regex`` (a layout regex) takes, in order, and the spans of
        their lines (runs of adjacent lines merged)."""
        text, name, new, count, stamps = block.text, self.name, object.__new__, block.text.count, _TS_CACHE
        append = out.append
        line, run_start, run_end = block.first_line, 0, -2
        last_scale: object = _UNSET  # the loss scale (often the learning rate too) stays for many lines
        last_lr: object = _UNSET
        scale_t = lr_t = (LOSS_SCALE, 0.0, ())  # the values of last_scale and last_lr
        last_minute: str | None = None
        base: float | None = None
        for m in regex.finditer("\n" + text):
            minute, sec, step, lr, loss, scale, gnorm, skipped, nans = m.groups()
            try:  # the common case: all four present and plain numbers, counters 0 (then None)
                if scale != last_scale:
                    scale_t, last_scale = (LOSS_SCALE, float(scale), ()), scale  # type: ignore[arg-type]
                if lr != last_lr:
                    lr_t, last_lr = (LEARNING_RATE, float(lr), ()), lr  # type: ignore[arg-type]
                values = [(LOSS, float(loss), ()), scale_t, (GRAD_NORM, float(gnorm), ()), lr_t]  # type: ignore[arg-type]
                if skipped is not None or nans is not None:
                    values = _shaped(lr, loss, scale, gnorm, skipped, nans)
            except (TypeError, ValueError):
                if lr is None and loss is None and scale is None:
                    continue  # some other "iteration N/M |" text
                values = _shaped(lr, loss, scale, gnorm, skipped, nans)
            start, end = m.span()  # "\n" in front: the line's start and end in ``text``
            if start == run_end + 1:  # the line after the last record's
                line += 1
            else:
                line += count("\n", max(run_end, 0), start)
                if run_end >= 0:
                    spans.append((run_start, run_end))
                run_start = start
            run_end = end - 1
            rec = new(Record)  # Record(...) costs twice as much: this runs once per line
            rec.line = line
            rec.pos = start + 1 if minute is None else start + _STAMPED_AT
            rec.values = values
            rec.step = int(step) if len(step) < 19 else None  # int64 (to_step, inline)
            if minute is None:
                rec.log_time = None
            else:
                if minute != last_minute:  # consecutive lines mostly share their minute
                    last_minute, base = minute, stamps.get(minute)
                    if base is None:
                        base = minute_seconds(minute)
                rec.log_time = None if base is None else base + _SECONDS[sec]
            rec.rank = None
            rec.producer = name
            rec.end = run_end
            append(rec)
        if run_end >= 0:
            spans.append((run_start, run_end))

    def _others(self, block: Block, start: int, end: int, out: list[Record]) -> None:
        """Records of the lines between layout lines: iteration lines of any other shape and
        validation lines."""
        self._general(block, start, end, out)
        text = block.text
        if text.find("validation loss", start, end) >= 0:
            for m in _VALID_RE.finditer(text, start, end):
                if (v := _field(m.group(2), "lm loss value:")) is None:
                    continue
                rec = self.record(block, m.start(), to_step(m.group(1)))
                rec.add(EVAL_LOSS, v)
                out.append(rec)

    def _general(self, block: Block, start: int, end: int, out: list[Record]) -> None:
        """Records of iteration lines in ``text[start:end]`` by the general regex."""
        text, name, new = block.text, self.name, block.record
        for m in _ITER_RE.finditer(text, start, end):
            stamp, step, _total, lr, loss, scale, gnorm, skipped, nans, rest = m.groups()
            if rest is None:
                if lr is None and loss is None and scale is None:
                    continue  # some other "iteration N/M |" text
                values = _shaped(lr, loss, scale, gnorm, skipped, nans)
            elif (values := _general(rest)) is None:
                continue
            pos = m.start()
            if stamp is not None:  # the stamp counts only as the first thing on its line
                bracket = pos - _STAMPED
                line_start = text.rfind("\n", 0, bracket) + 1
                if pos >= line_start + 120 or (bracket != line_start and not text[line_start:bracket].isspace()):
                    stamp = None
            out.append(new(pos, to_step(step), name, values, stamp))
