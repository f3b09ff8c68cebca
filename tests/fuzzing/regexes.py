"""Fuzz target of the regexes a user writes (agent/config/regex.py, issue 23): one pattern per case,
used at once as a rule's ``match`` on the run label, as a custom log ``pattern`` and as a dump
watch's ``digest``, against hostile lines and names made to trap a backtracking engine.

The patterns are the classic catastrophic-backtracking shapes (``(a+)+b``, ``(\\d+\\s?)+$``, ...),
what RE2 refuses (backreferences, lookaround, possessive, atomic), and random edits of both; each
text repeats the pattern's attack string (a long run the pattern almost matches) among NULs,
ANSI, invalid UTF-8 and non-ASCII. A case checks progress, not only the exit: every line of the
log is read, the NaN written after the hostile lines is paged by a rule that sits beside the
hostile matcher, and every tensor is digested. A pattern RE2 refuses must be a ``ConfigError``
naming the rule file's ``match.labels`` field, and a ``ValueError`` for the parser and the digest.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from precision_agent.compare.digest import step_digests
from precision_agent.config import ConfigError
from precision_agent.config.regex import UserRegex
from precision_agent.dumps.types import DumpTensor
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import load_rule_file, load_rules
from precision_agent.readers.logstream import LogStream
from precision_agent.readers.runs import run_labels

from . import mutate
from .core import Target
from .mutate import pick

# (pattern, attack string): the pattern backtracks exponentially (or polynomially) on long runs of
# the attack string followed by something that makes the match fail
TRAPS = [
    (r"(a+)+b", "a"), (r"(a|a)*c", "a"), (r"(a|aa)+$", "a"), (r"(a*)*b", "a"), (r"(\d+\s?)+$", "1"),
    (r"(x+x+)+y", "x"), (r"^(\w+\s?)*$", "word "), (r"([a-z]+)*[0-9]", "abc"), (r"(\s*,?)*;", " ,"),
    (r".*.*.*=.*;", "x="), (r"(?:[^\"\\]|\\.)*\"", "\\a"), (r"(\w+\d+)+_", "a1"), (r"(.*a){12}", "a"),
    (r"(?i)(A+B?)+C", "aB"), (r"^(([a-z])+.)+[A-Z]([a-z])+$", "aaaa"), (r"(\.\d+|\d+\.?)+e", "1."),
    (r"(?s)(.|\n)*\x00", "\n"), (r"\S+\s+\S+$", "a a"), (r"(?m)^(\d+)*$", "12"), (r"[\pL\pN]+(\pL+)+!", "é1"),
]
REFUSED = [r"(a)\1", r"(?P<x>a)(?P=x)", r"(?=a)a+", r"(?!b)a", r"(?<=x)a", r"(?<!x)a", r"a++b", r"(?>a+)b",
           r"(?x) a b", r"a\Z", "(", "a{1001}", "[", r"\p{Nope}"]
PIECES = ["(", ")", "+", "*", "?", "|", "{2,}", "\\1", "(?=", "(?<", "[", "]", "^", "$", "\\d", "\\s", ".", "a",
          "(?P<step>", "\\", "{1000}", "(?i)", "\x00", "é", "\\pL"]
TAILS = ["!", "x", "b", "\x00", "\udcff", "é", "\r", "\x1b[31m", "", " ", "\t"]


def _make(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.15:
        pattern, attack = pick(rng, REFUSED), "a"
    else:
        pattern, attack = pick(rng, TRAPS)
        if rng.random() < 0.2:
            pattern = mutate.mutate_text(rng, pattern, PIECES, 200)
    n = rng.choice((34, 40, 100, 1000, 20_000))
    hostile = attack * (n // max(1, len(attack)) + 1) + pick(rng, TAILS)
    lines = [hostile[: mutate.TEXT_MAX]]
    for _ in range(rng.randint(0, 4)):
        lines.append(mutate.mutate_text(rng, hostile[: rng.randint(1, 300)], [*mutate.JUNK, attack], 2000))
    name = "".join(c for c in hostile[:rng.choice((34, 100, 200))] if c not in "/\x00") or "a"
    return {"pattern": pattern, "lines": lines, "name": name, "label": hostile[:300]}


def _rule_file(pattern: str, work: Path) -> Path:
    rules = [{"alert": "Hostile", "kind": "nonfinite", "match": {"labels": {"run": pattern, "job": pattern}},
              "params": {"metrics": ["loss"]}, "labels": {"severity": "warning"}},
             {"alert": "Canary", "kind": "nonfinite", "params": {"metrics": ["loss"]}, "labels": {"severity": "page"}}]
    path = work / "rules.yml"
    # single-quoted: the loader's nesting pre-check skips brackets in quotes, not in plain scalars
    path.write_text(yaml.safe_dump({"groups": [{"name": "fuzz", "rules": rules}]}, allow_unicode=True,
                                   default_style="'"),
                    encoding="utf-8", errors="surrogatepass")
    return path


def _refused(pattern: str, work: Path) -> None:
    try:
        load_rule_file(_rule_file(pattern, work))
    except ConfigError as exc:
        if "match.labels" not in str(exc) and "(yaml)" not in str(exc):
            raise AssertionError(f"refused pattern reported without its field: {exc}") from None
    else:
        raise AssertionError(f"a rule file with {pattern!r} loaded")
    for what, fn in (("custom pattern", lambda: LogStream(str(work / "x.log"), {}, "custom", pattern=pattern)),
                     ("digest", lambda: step_digests([], pattern))):
        try:
            fn()
        except ValueError as exc:   # UnknownFormat for the reader
            if "invalid regex" not in str(exc):
                raise AssertionError(f"{what}: refused pattern reported without its reason: {exc}") from None
        else:
            raise AssertionError(f"{what}: {pattern!r} accepted")


def _spans_canary(pattern: str, body: str) -> bool:
    """Whether a match of ``pattern`` alone starts before the canary line and runs into it (then
    the custom format's hostile branch rightly takes the canary's text)."""
    c = body.rindex("canary loss=")
    for start, groups in UserRegex(pattern, multiline=True).matches(body):
        if start >= c:
            return False
        if start + len(groups[0] or "") > c:
            return True
    return False


def _run(case: dict[str, Any], work: Path) -> None:
    pattern = case["pattern"]
    try:
        UserRegex(pattern)
    except ValueError:
        _refused(pattern, work)
        return
    # the log: hostile lines, then a NaN the Canary rule must page (the worker got past them)
    log = os.path.join(os.fsencode(work), os.fsencode(case["name"])[:200] + b".log")
    body = "\n".join(case["lines"]) + "\ncanary loss=nan\n"
    with open(log, "wb") as f:
        f.write(body.encode("utf-8", "surrogateescape" if "\udcff" in body else "strict"))
    n_lines = body.count("\n")
    labels = run_labels(os.fsdecode(log), "file", {"job": case["label"]})
    # the canary branch first: at the canary line's start it wins over the hostile one (read as a
    # learning rate: an overflow would make the NaN a loss scaler's skipped step, rightly not paged)
    custom = f"canary loss=(?P<loss>\\S+)$|(?P<lr>{pattern})"
    try:
        stream = LogStream(os.fsdecode(log), labels, "custom", pattern=custom, max_line_bytes=1 << 20)
    except ValueError as exc:   # an edited pattern that matches "" or names a group: refused, read without it
        if "custom log format" not in str(exc):
            raise
        stream = LogStream(os.fsdecode(log), labels, "custom", pattern="canary loss=(?P<loss>\\S+)$",
                           max_line_bytes=1 << 20)
    try:
        samples = stream.poll(64 << 20) + stream.finish()
    finally:
        stream.close()
    if stream.stats.lines != n_lines:
        raise AssertionError(f"{stream.stats.lines} of {n_lines} lines read")
    # unless a hostile match runs through the canary line (e.g. (?s).*: the canary is its text)
    expect = not _spans_canary(pattern, body)
    if expect and not any(s.metric == "loss" and math.isnan(s.value) and s.source.line == n_lines for s in samples):
        raise AssertionError("the NaN after the hostile lines was not read")
    rules = load_rules([_rule_file(pattern, work)])
    if rules.errors:
        raise AssertionError(f"a rule file with a valid regex refused: {list(rules.errors.values())[0]}")
    findings = Pipeline(rules).process(samples)   # Hostile's matcher on each
    if expect and not any(f.rule == "Canary" and f.source is not None and f.source.line == n_lines for f in findings):
        raise AssertionError(f"the NaN was not paged: {[(f.rule, f.source) for f in findings]}")
    # the digest: every tensor looked at, the canary one always taken
    w = np.zeros(2, dtype=np.float32)
    names = [case["name"], case["label"], *case["lines"][:3], "canary"]
    tensors = [DumpTensor(name=n, io="input", index=1, dtype="float32", shape=(2,), order=i, step=1, rank=0,
                          load=lambda: w) for i, n in enumerate(names)]
    digests = step_digests(tensors, f"(?:{pattern})|^canary ")
    if not digests or not 1 <= sum(d.tensors for d in digests) <= len(tensors):
        raise AssertionError(f"digest over {len(tensors)} tensors: {digests}")


TARGETS = [Target("user_regex", _make, _run)]
