"""The regexes a user writes, matched in time linear in the text: RE2 syntax and semantics, as
Prometheus and Alertmanager use for every regex in their configuration.

Every regex that comes from a config or rule file goes through :class:`UserRegex`: rule label
matchers (``match: {labels: ...}``), a log watch's custom format (``pattern``), a dump watch's
``digest``, the tensor-health kinds' classification lists, and ``rules test --run``. The text
they run on is not the user's to choose (log lines, file and run names, tensor names), and a
backtracking engine such as Python's ``re`` takes exponential time on some pattern/text pairs
(``(a+)+b`` on a run of 34 ``a``: minutes, holding the worker and the GIL). RE2 has no
backtracking: a match costs time proportional to the text whatever the pattern, and the binding
releases the GIL while it runs, so the HTTP threads and signal handling carry on.

What RE2 cannot express (backreferences, lookahead and lookbehind, possessive quantifiers, atomic
groups, ``(?x)``, ``\\Z``) raises ``ValueError`` with the reason and a hint when the regex is
compiled, i.e. when its file is loaded, so it is a config error like any other field. Both
``(?P<name>...)`` and ``(?<name>...)`` name a group. The character classes are RE2's: ``\\d``,
``\\w``, ``\\s`` are ASCII (``\\pN``, ``\\pL`` for Unicode), ``.`` does not match a newline.

The agent's own regexes for the built-in log formats stay on ``re``: they are ours, reviewed for
linear behaviour, and ``re`` is faster per match.
"""

from __future__ import annotations

import re
from typing import Iterator

import re2

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False   # RE2 would print every parse error on stderr besides raising it

# The binding's fast path: one C++ call per match with byte spans back (its public ``finditer``
# builds a Python match object and converts every offset per match, several times slower).
# Both are in google-re2 1.x; without them ``matches`` takes the public API.
_ANCHOR = getattr(re2, "_Anchor", None)
_UNANCHORED = getattr(_ANCHOR, "UNANCHORED", None)
_ANCHOR_BOTH = getattr(_ANCHOR, "ANCHOR_BOTH", None)

# Hints for what RE2 refuses, keyed by text of its error message.
_HINTS = (
    (("(?=", "(?!", "(?<=", "(?<!"), "lookahead and lookbehind are not supported"),
    (("(?>",), "atomic groups are not supported"),
    (("++", "*+", "?+", "}+"), "possessive quantifiers are not supported"),
    (("(?x", "(?u", "(?a", "(?L"), "only the flags i, m, s and U are supported"),
    (("\\Z",), "use \\z for the end of the text"),
)
_BACKREF = re.compile(r"invalid escape sequence: \\[1-9]")
_NAMED = re.compile(r"(?<!\\)\(\?P?<([A-Za-z_][A-Za-z0-9_]*)>")


def _reason(exc: Exception, pattern: str) -> str:
    raw = exc.args[0] if exc.args else str(exc)
    msg = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    backref = _BACKREF.search(msg) or "(?P" in msg and "(?P=" in pattern
    hint = "backreferences are not supported" if backref else \
        next((h for keys, h in _HINTS if any(k in msg for k in keys)), "")
    if "too large" in msg or "too big" in msg:
        hint = "counted repetitions such as {1000} make it large"
    return f"{msg} ({hint}; RE2 syntax, as Prometheus)" if hint else f"{msg} (RE2 syntax, as Prometheus)"


def _bytes(text: str) -> bytes:
    # lone surrogates (file names decoded with surrogateescape) must not raise: match their bytes
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _text(b: bytes) -> str:
    """The text ``_bytes`` encoded as ``b`` (a cut character: U+FFFD)."""
    try:
        return b.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return b.decode("utf-8", "replace")


class UserRegex:
    """One user regex compiled by RE2. ``what`` names it in errors ("custom log format", ...).
    ``multiline``: ``^``/``$`` match at line boundaries (as ``re.M``)."""

    __slots__ = ("pattern", "groupindex", "groups", "_rx", "_match")

    def __init__(self, pattern: str, what: str = "regex", *, multiline: bool = False) -> None:
        if not isinstance(pattern, str):
            raise ValueError(f"{what}: a regex must be a string, not {type(pattern).__name__}")
        self.pattern = pattern
        try:
            self._rx = re2.compile(("(?m)" if multiline else "") + pattern, _OPTIONS)
        except re2.error as exc:
            raise ValueError(f"{what}: invalid regex {pattern!r}: {_reason(exc, pattern)}") from None
        except (TypeError, ValueError, UnicodeError) as exc:   # NUL, surrogates: the binding's own refusals
            raise ValueError(f"{what}: invalid regex {pattern!r}: {exc}") from None
        self.groupindex: dict[str, int] = dict(self._rx.groupindex)
        self.groups: int = self._rx.groups
        names = _NAMED.findall(pattern)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{what}: invalid regex {pattern!r}: group name(s) {', '.join(dup)} used twice")
        raw = getattr(self._rx, "_regexp", None)
        self._match = raw.Match if raw is not None and _UNANCHORED is not None else None

    def __repr__(self) -> str:
        return f"UserRegex({self.pattern!r})"

    def __eq__(self, other: object) -> bool:   # the compiled text: pattern and (?m)
        return isinstance(other, UserRegex) and other._rx.pattern == self._rx.pattern

    def __hash__(self) -> int:
        return hash(self._rx.pattern)

    def search(self, text: str) -> bool:
        """Whether the regex matches anywhere in ``text``."""
        b = _bytes(text)
        if self._match is not None:
            return self._match(_UNANCHORED, b, 0, len(b))[0][0] >= 0
        return self._rx.search(b) is not None

    def fullmatch(self, text: str) -> bool:
        """Whether the regex matches the whole of ``text`` (anchored at both ends, as Prometheus
        anchors label matchers)."""
        b = _bytes(text)
        if self._match is not None:
            return self._match(_ANCHOR_BOTH, b, 0, len(b))[0][0] >= 0
        return self._rx.fullmatch(b) is not None

    def matches(self, text: str, groups: tuple[int, ...] | None = None) -> Iterator[tuple[int, list[str | None]]]:
        """Every non-overlapping match in ``text``, left to right: its start (a character index
        into ``text``) and the text of each group in ``groups`` (default: all, 0 being the whole
        match; None: the group took no part)."""
        wanted = tuple(range(self.groups + 1)) if groups is None else groups
        b = _bytes(text)
        if len(b) == len(text):   # ASCII: byte and character offsets are the same, groups are slices
            for start, spans in self._spans(b):
                yield start, [text[s:e] if (s := spans[i][0]) >= 0 and (e := spans[i][1]) >= 0 else None
                              for i in wanted]
            return
        last_b = last_c = 0
        for start, spans in self._spans(b):
            last_c += len(_text(b[last_b:start]))   # offsets grow: each byte is decoded once
            last_b = start
            yield last_c, [None if spans[i][0] < 0 else _text(b[spans[i][0]:spans[i][1]]) for i in wanted]

    def _spans(self, b: bytes) -> Iterator[tuple[int, list[tuple[int, int]]]]:
        end = len(b)
        if self._match is None:
            for m in self._rx.finditer(b):
                yield m.start(), [m.span(i) for i in range(self.groups + 1)]
            return
        match, pos = self._match, 0
        while pos <= end:
            spans = match(_UNANCHORED, b, pos, end)
            s, e = spans[0]
            if s < 0:
                return
            yield s, spans
            if e > s:
                pos = e
            else:   # an empty match moves on by one character
                pos = e + 1
                while pos < end and b[pos] & 0xC0 == 0x80:
                    pos += 1
