"""A user-defined log format: one regex (RE2 syntax, as Prometheus: ``agent/config/regex.py``)
whose named groups say what each capture is.

``RegexParser(r"it (?P<step>\\d+) loss=(?P<loss>\\S+)")``. Known groups: ``step``, ``loss``,
``eval_loss``, ``grad_norm``, ``loss_scale``, ``lr`` (numbers, NaN/Inf spellings included),
``overflow`` and ``nonfinite`` (any non-empty capture is one event). The pattern is checked when the
parser is built: a regex that RE2 cannot take (backreferences, lookaround...), that has no known
group, an unknown group or a group name twice, or that can match an empty string raises
``ValueError`` with a message meant for a config error. Matching takes time linear in the block
whatever the pattern and the line (``(\\d+\\s?)+$`` on a line of 40 digits included).

The class is not a registered format (``name = ""`` at class level, so discovery skips it); the
config layer builds it with the user's pattern, and the instance is named ``custom``. It is
matched over whole blocks in multi-line mode (``^``/``$`` are line anchors), anywhere in a line.
"""

from __future__ import annotations

import math

from ...config.regex import UserRegex
from ...model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, OVERFLOW
from .base import Block, Parser, Record, to_float, to_step

VALUE_GROUPS = {"loss": LOSS, "eval_loss": EVAL_LOSS, "grad_norm": GRAD_NORM, "loss_scale": LOSS_SCALE,
                "lr": LEARNING_RATE}
EVENT_GROUPS = ("overflow", "nonfinite")
KNOWN_GROUPS = ("step", *VALUE_GROUPS, *EVENT_GROUPS)


class RegexParser(Parser):
    name = ""          # not auto-registered; the instance is named "custom"
    priority = 5       # a format the user spelled out beats every built-in guess
    keywords = ()

    def __init__(self, pattern: str) -> None:
        self.name = "custom"
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("custom log format: the regex is empty")
        self.regex = UserRegex(pattern, "custom log format", multiline=True)
        groups = set(self.regex.groupindex)
        unknown = sorted(groups - set(KNOWN_GROUPS))
        if unknown:
            raise ValueError(f"custom log format: unknown named group(s) {', '.join(unknown)} in {pattern!r}; "
                             f"known: {', '.join(KNOWN_GROUPS)}")
        if not groups - {"step"}:
            raise ValueError(f"custom log format: {pattern!r} has no named group to read a value from; "
                             f"use at least one of {', '.join(g for g in KNOWN_GROUPS if g != 'step')}")
        if self.regex.search(""):
            raise ValueError(f"custom log format: {pattern!r} matches an empty string; make it require text")
        # only the named groups are read out of a match, at these places of its list
        names = [g for g in KNOWN_GROUPS if g in groups]
        self._wanted = tuple(self.regex.groupindex[g] for g in names)
        at = {g: i for i, g in enumerate(names)}
        self._step = at.get("step")
        self._values = tuple((at[g], metric) for g, metric in VALUE_GROUPS.items() if g in at)
        self._overflow = at.get("overflow")
        self._nonfinite = at.get("nonfinite")

    def wants(self, text: str) -> bool:
        return True

    def parse(self, block: Block) -> list[Record]:
        out: list[Record] = []
        step_at, values, overflow_at, nonfinite_at = self._step, self._values, self._overflow, self._nonfinite
        for pos, g in self.regex.matches(block.text, self._wanted):
            rec = self.record(block, pos)
            if step_at is not None and (raw := g[step_at]) and (s := to_float(raw)) is not None \
                    and math.isfinite(s):
                rec.step = to_step(s)
            for i, metric in values:
                if (raw := g[i]) and (v := to_float(raw)) is not None:
                    rec.add(metric, v)
            if overflow_at is not None and g[overflow_at]:
                rec.add(OVERFLOW, 1.0, variant="custom")
            if nonfinite_at is not None and g[nonfinite_at]:
                rec.add(NONFINITE_MESSAGE, 1.0, what="loss")
            if rec.values:
                out.append(rec)
        return out
