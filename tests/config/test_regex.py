"""User regexes (agent/config/regex.py): RE2 syntax and semantics, linear in the text whatever the
pattern; what RE2 cannot take is a ValueError with the reason and a hint, raised at load."""

from __future__ import annotations

import re
import threading

import pytest

from precision_agent.config import ConfigError, load_config
from precision_agent.config.regex import UserRegex

DEADLINE_S = 60.0   # a generous bound: on a backtracking engine these cases take hours or more


def finishes(fn, *args):
    """Run ``fn(*args)`` in a thread and return its result; fail if it is still running at the
    deadline (a backtracking match of these inputs would run for hours, holding the GIL)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), f"{fn} still running after {DEADLINE_S:.0f} s"
    return out[0]


@pytest.mark.parametrize("pattern, text, method", [
    (r"(a+)+b", "a" * 34, "fullmatch"),            # the rule match on a run named with 34 a
    (r"(a+)+b", "a" * 100_000, "search"),
    (r"(\d+\s?)+$", "1" * 40 + "x", "search"),      # the custom pattern on 40 digits
    (r"(x+x+)+y", "x" * 5000, "search"),
    (r"^(\w+\s?)*$", "word " * 2000 + "!", "search"),
    (r"(.*a){20}", "a" * 5000 + "b", "fullmatch"),
])
def test_exponential_backtracking_cases_are_linear(pattern, text, method):
    rx = UserRegex(pattern)
    assert finishes(getattr(rx, method), text) is False


def test_custom_block_matches_are_linear_and_in_character_offsets():
    rx = UserRegex(r"(?:loss=(?P<loss>\S+)|(\d+\s?)+)$", multiline=True)
    text = "1" * 40 + "x\n" + "é loss=2.5\n" + ("9 " * 50_000) + "z\nloss=nan\n"
    got = finishes(lambda: list(rx.matches(text)))
    starts = [pos for pos, _ in got]
    assert [g[rx.groupindex["loss"]] for _, g in got] == ["2.5", "nan"]
    assert [text[p:p + 5] for p in starts] == ["loss=", "loss="]   # character, not byte, offsets


@pytest.mark.parametrize("pattern, hint", [
    (r"(a)\1", "backreferences are not supported"),
    (r"(?P<x>a)(?P=x)", "backreferences are not supported"),
    (r"(?=step)\d+", "lookahead and lookbehind are not supported"),
    (r"(?!x)a", "lookahead and lookbehind are not supported"),
    (r"(?<=x)a", "lookahead and lookbehind are not supported"),
    (r"(?<!x)a", "lookahead and lookbehind are not supported"),
    (r"a++", "possessive quantifiers are not supported"),
    (r"\d*+", "possessive quantifiers are not supported"),
    (r"(?>a|ab)c", "atomic groups are not supported"),
    (r"(?x) a b", "only the flags i, m, s and U are supported"),
    (r"end\Z", r"use \z for the end of the text"),
    (r"(", "RE2 syntax, as Prometheus"),
    (r"a{1001}", "RE2 syntax, as Prometheus"),
])
def test_what_re2_cannot_take_is_a_clear_error(pattern, hint):
    with pytest.raises(ValueError) as err:
        UserRegex(pattern, "custom log format")
    msg = str(err.value)
    assert msg.startswith("custom log format: invalid regex ") and hint in msg and repr(pattern) in msg


def test_named_groups_in_both_spellings_and_no_name_twice():
    for pattern in (r"step (?P<step>\d+) loss (?P<loss>\S+)", r"step (?<step>\d+) loss (?<loss>\S+)"):
        rx = UserRegex(pattern, multiline=True)
        assert rx.groupindex == {"step": 1, "loss": 2}
        assert list(rx.matches("x step 7 loss 2.5\n")) == [(2, ["step 7 loss 2.5", "7", "2.5"])]
    with pytest.raises(ValueError, match="group name.* step used twice"):
        UserRegex(r"(?P<step>\d+) (?P<step>\d+)")


def test_label_matching_is_anchored_as_in_prometheus():
    rx = UserRegex("gpt-.*")
    assert rx.fullmatch("gpt-7b") and not rx.fullmatch("my-gpt-7b") and not rx.fullmatch("gpt")
    assert UserRegex("gpt|llama").fullmatch("llama") and not UserRegex("gpt|llama").fullmatch("gptx")
    assert UserRegex(".*").fullmatch("") and not UserRegex(".+").fullmatch("")   # a missing label is ""
    assert UserRegex("gpt").search("my-gpt-7b")   # search (digest, rules test --run) is not anchored


def test_re2_semantics_multiline_anchors_and_ascii_classes():
    rx = UserRegex(r"^loss (?P<loss>\S+)$", multiline=True)
    assert [g[1] for _, g in rx.matches("loss 1\nxloss 2\nloss 3\n")] == ["1", "3"]
    assert not UserRegex(r"^loss$").search("loss\n")   # without multiline, $ is the end of the text only
    assert not UserRegex(r"\d").search("٣") and UserRegex(r"\pN").search("٣")   # \d is ASCII, as in RE2


def test_hostile_text_never_raises():
    rx = UserRegex(r"a.c", multiline=True)
    assert rx.search("a\udcffc") in (True, False)   # a lone surrogate (a file name's bad byte): no error
    assert rx.fullmatch("\x00" * 10) is False
    got = list(UserRegex(r"(?P<loss>\S+)", multiline=True).matches("é\udcff ü\x00x\n\ufffd"))
    assert [(pos, g[0]) for pos, g in got] == [(0, "é\udcff"), (3, "ü\x00x"), (7, "\ufffd")]
    empty = UserRegex(r"\b", multiline=True)   # empty matches move on one character, not one byte
    assert [pos for pos, _ in empty.matches("éé xü")] == [m.start() for m in re.finditer(r"(?a)\b", "éé xü")]


def test_config_names_the_field_of_a_regex_re2_cannot_take(tmp_path):
    path = tmp_path / "agent.yml"
    path.write_text("watches:\n"
                    "  - {path: /x, format: custom, pattern: '(?<=loss )(?P<loss>\\S+)'}\n"
                    "  - {path: /d, kind: dump, digest: '(w)\\1'}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert "watches.0.pattern" in text and "lookahead and lookbehind are not supported" in text
    assert "watches.1.digest" in text and "backreferences are not supported" in text
