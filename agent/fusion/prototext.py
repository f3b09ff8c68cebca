"""A bounded reader of protobuf *text format* (what GE writes in ``ge_proto_*.txt``), with no
protobuf compiler and no schema.

Grammar read: fields ``name: scalar`` and ``name { ... }`` (also ``name: { ... }`` and ``< ... >``),
the list shorthand ``name: [a, b]``, optional ``,`` / ``;`` after a field, ``#`` comments, quoted
strings ("..." or '...') with C escapes (``\\n \\t \\" \\\\ \\ooo \\xHH \\uXXXX``; adjacent strings
concatenate), integers, floats and bare identifiers (enum values, true/false, inf, nan).

Bounds: nesting depth (an explicit stack, never Python recursion) and the text size the caller
reads. A message can be handed to a callback as soon as it closes (``on_close``) so that a big
graph need not be held whole: the callback returns True to drop the message from its parent.
Strings longer than ``max_string`` (a graph's weights) are kept as they stand in the text
(:class:`Unread`), never decoded. The parse beats the calling thread's heartbeat
(``health.beat``) every few thousand tokens, so a long parse on a worker is not taken for a hang.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Union

from ..health import beat

MAX_DEPTH = 64
BEAT_EVERY = 4096  # tokens between heartbeats: a few milliseconds of parsing

Scalar = Union[str, int, float, bool]
Value = Union[Scalar, "Message"]


class ProtoTextError(ValueError):
    """Malformed text: says where (line) and what."""

    def __init__(self, line: int, reason: str) -> None:
        self.line, self.reason = line, reason
        super().__init__(f"line {line}: {reason}")


@dataclass
class Message:
    """One message: its fields in file order (a repeated field appears several times)."""
    fields: list[tuple[str, Value]] = field(default_factory=list)

    def get(self, name: str) -> Value | None:
        for k, v in self.fields:
            if k == name:
                return v
        return None

    def all(self, name: str) -> list[Value]:
        return [v for k, v in self.fields if k == name]

    def messages(self, name: str) -> list[Message]:
        return [v for k, v in self.fields if k == name and isinstance(v, Message)]


class Enum(str):
    """A bare identifier value (an enum name such as DT_FLOAT), kept apart from quoted strings."""


class Unread(str):
    """A quoted string over ``max_string`` characters, its body as it stands in the text (escapes
    not decoded): a graph's weights, which nobody reads, cost no decoding."""


_TOKEN = re.compile(r"""
  (?:[ \t\r\n\f\v]+|\#[^\n]*)*             # whitespace and comments, skipped with the token
  (?:
    (?P<kv>(?P<kn>[A-Za-z_][A-Za-z0-9_]*)[ \t\r\n]*:[ \t\r\n]*   # the common "name: value" in one token
      (?:(?P<ks>"[^"\\\n]*(?:\\.[^"\\\n]*)*")
       | (?P<kd>[-+]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)[fF]?(?![A-Za-z_]))
       | (?P<ki>-?[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)))
  | (?P<str>"[^"\\\n]*(?:\\.[^"\\\n]*)*"|'[^'\\\n]*(?:\\.[^'\\\n]*)*')   # unrolled: one step per run
  | (?P<num>[-+]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)[fF]?(?![A-Za-z_]))
  | (?P<id>-?[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<p>[{}<>:\[\],;])
  | (?P<bad>.)
  | \Z
  )
""", re.X | re.S)
_SIMPLE_ESCAPES = {"n": 10, "t": 9, "r": 13, "a": 7, "b": 8, "f": 12, "v": 11,
                   "\\": 92, "'": 39, '"': 34, "?": 63}
_ESCAPE = re.compile(r"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{1,2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|(.))", re.S)


def unescape(body: str) -> str:
    """The text of a quoted string's body: C escapes give bytes, decoded as UTF-8 (bad bytes
    become U+FFFD), as GE's bytes fields are text in practice."""
    if "\\" not in body:
        return body
    out = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(body):
        out += body[pos:m.start()].encode("utf-8", "surrogateescape")
        octal, hexa, u4, u8, simple = m.groups()
        if octal is not None:
            out.append(int(octal, 8) & 0xFF)
        elif hexa is not None:
            out.append(int(hexa, 16))
        elif u4 is not None or u8 is not None:
            out += chr(min(int(u4 or u8, 16), 0x10FFFF)).encode("utf-8", "surrogatepass")
        elif simple in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[simple])
        else:
            raise ValueError(f"unknown escape \\{simple}")
        pos = m.end()
    out += body[pos:].encode("utf-8", "surrogateescape")
    return out.decode("utf-8", "replace")


def _scalar(kind: str, text: str) -> Scalar:
    if kind == "num":
        if text.isdigit():
            return int(text)
        t = text.rstrip("fF") if not text.lower().startswith(("0x", "-0x", "+0x")) else text
        if re.fullmatch(r"[-+]?(0[xX][0-9a-fA-F]+)", t):
            return int(t, 16)
        if re.fullmatch(r"[-+]?\d+", t):
            return int(t)
        return float(t)
    if text in ("true", "True", "t"):
        return True
    if text in ("false", "False", "f"):
        return False
    if text.lstrip("-").lower() in ("inf", "infinity", "nan"):
        return float(text)
    return Enum(text)


_FIELD, _AFTER_NAME, _VALUE, _LIST_VALUE, _LIST_SEP = range(5)


def _misplaced(state: int, name: str, key: str) -> str:
    """The error for a ``key: value`` token where no field may start."""
    if state == _AFTER_NAME:
        return f"expected ':' or '{{' after {name!r}, got {key!r}"
    if state == _VALUE:
        return "expected a field name, got ':'"
    if state == _LIST_VALUE:
        return f"expected ',' or ']' in the list of {name!r}, got ':'"
    return f"expected ',' or ']' in the list of {name!r}, got {key!r}"


def parse(text: str, max_depth: int = MAX_DEPTH,
          on_close: Callable[[list[str], Message], bool] | None = None, max_string: int | None = None,
          ) -> Message:
    """Parse a whole text-format message. ``on_close(path, msg)`` sees each sub-message when it
    closes (``path``: the field names from the top, the message's own last); returning True drops
    it from its parent. Strings longer than ``max_string`` stay :class:`Unread`. One pass over the
    tokens with a small state machine (no recursion)."""
    root = current = Message()
    stack: list[tuple[Message, str, str]] = []  # (parent, field name, closing bracket)
    names: list[str] = []
    state, name, concat = _FIELD, "", False     # concat: the last token was a string value

    def fail(m: re.Match[str] | None, reason: str) -> ProtoTextError:
        at = m.start(m.lastgroup or 0) if m is not None else len(text)
        return ProtoTextError(text.count("\n", 0, at) + 1, reason)

    def string(m: re.Match[str], group: str = "str") -> str:
        body = m.group(group)[1:-1]
        if max_string is not None and len(body) > max_string:
            return Unread(body)
        try:
            return unescape(body)
        except ValueError as exc:
            raise fail(m, str(exc)) from None

    for count, m in enumerate(_TOKEN.finditer(text)):
        if not count % BEAT_EVERY:
            beat()
        kind = m.lastgroup
        if kind is None:  # the end of the text
            continue
        if kind == "kv":
            if state != _FIELD:  # what the tokens one by one would have said
                raise fail(m, _misplaced(state, name, m.group("kn")))
            name = m.group("kn")
            if m.group("ks") is not None:
                current.fields.append((name, string(m, "ks")))
                concat = True
            else:
                num = m.group("kd")
                current.fields.append((name, _scalar("num", num) if num is not None else _scalar("id", m.group("ki"))))
                concat = False
            continue
        tok = m.group(kind)
        if kind == "str":
            if state in (_VALUE, _LIST_VALUE):
                current.fields.append((name, string(m)))
                state, concat = (_FIELD if state == _VALUE else _LIST_SEP), True
                continue
            if concat:  # adjacent quoted strings concatenate
                key, prev = current.fields[-1]
                more = string(m)
                joined = f"{prev}{more}"
                current.fields[-1] = (key, Unread(joined) if isinstance(prev, Unread) or isinstance(more, Unread)
                                      else joined)
                continue
        concat = False
        if kind == "bad":
            raise fail(m, f"unexpected character {tok!r}")
        if state == _FIELD:
            if kind == "id" and not tok.startswith("-"):
                name, state = tok, _AFTER_NAME
            elif kind == "p" and tok in ",;":
                pass
            elif kind == "p" and tok in "}>":
                if not stack or stack[-1][2] != tok:
                    raise fail(m, f"unexpected {tok!r}")
                parent, field_name, _ = stack.pop()
                if not (on_close and on_close(names, current)):
                    parent.fields.append((field_name, current))
                names.pop()
                current = parent
            else:
                raise fail(m, f"expected a field name, got {tok!r}")
        elif state in (_AFTER_NAME, _VALUE) and kind == "p" and tok in "{<":
            if len(stack) >= max_depth:
                raise fail(m, f"nested deeper than {max_depth} blocks")
            stack.append((current, name, "}" if tok == "{" else ">"))
            names.append(name)
            current, state = Message(), _FIELD
        elif state == _AFTER_NAME:
            if kind != "p" or tok != ":":
                raise fail(m, f"expected ':' or '{{' after {name!r}, got {tok!r}")
            state = _VALUE
        elif state == _VALUE:
            if kind == "p" and tok == "[":
                state = _LIST_VALUE
            elif kind in ("num", "id"):
                current.fields.append((name, _scalar(kind, tok)))
                state = _FIELD
            else:
                raise fail(m, f"expected a value, got {tok!r}")
        elif state == _LIST_VALUE:
            if kind == "p" and tok == "]":
                state = _FIELD
            elif kind in ("num", "id"):
                current.fields.append((name, _scalar(kind, tok)))
                state = _LIST_SEP
            else:
                raise fail(m, f"expected a value in the list of {name!r}, got {tok!r}")
        else:  # _LIST_SEP
            if kind == "p" and tok in ",]":
                state = _LIST_VALUE if tok == "," else _FIELD
            else:
                raise fail(m, f"expected ',' or ']' in the list of {name!r}, got {tok!r}")
    if state in (_LIST_VALUE, _LIST_SEP):
        raise fail(None, f"truncated: list of {name!r} not closed")
    if state != _FIELD:
        raise fail(None, f"truncated: no value for {name!r}")
    if stack:
        raise fail(None, f"truncated: {len(stack)} block(s) not closed (innermost {names[-1]!r})")
    return root
