"""A bounded reader of protobuf *text format* (what GE writes in ``ge_proto_*.txt``), with no
protobuf compiler and no schema.

Grammar read: fields ``name: scalar`` and ``name { ... }`` (also ``name: { ... }`` and ``< ... >``),
the list shorthand ``name: [a, b]``, optional ``,`` / ``;`` after a field, ``#`` comments, quoted
strings ("..." or '...') with C escapes (``\\n \\t \\" \\\\ \\ooo \\xHH \\uXXXX``; adjacent strings
concatenate), integers, floats and bare identifiers (enum values, true/false, inf, nan).

Bounds: nesting depth (an explicit stack, never Python recursion) and the text size the caller
reads. A message can be handed to a callback as soon as it closes (``on_close``) so that a big
graph need not be held whole: the callback returns True to drop the message from its parent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Union

MAX_DEPTH = 64

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


_TOKEN = re.compile(r"""
  (?P<ws>(?:[ \t\r\n\f\v]+|\#[^\n]*)+)
| (?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
| (?P<num>[-+]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)[fF]?(?![A-Za-z_]))
| (?P<id>-?[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
| (?P<p>[{}<>:\[\],;])
""", re.X)
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


def parse(text: str, max_depth: int = MAX_DEPTH,
          on_close: Callable[[list[str], Message], bool] | None = None) -> Message:
    """Parse a whole text-format message. ``on_close(path, msg)`` sees each sub-message when it
    closes (``path``: the field names from the top, the message's own last); returning True drops
    it from its parent."""
    root = Message()
    stack: list[tuple[Message, str, str]] = []  # (parent, field name, closing bracket)
    names: list[str] = []
    current = root
    pos, end = 0, len(text)
    match = _TOKEN.match

    def line() -> int:
        return text.count("\n", 0, pos) + 1

    def token() -> tuple[str, str]:
        nonlocal pos
        while True:
            if pos >= end:
                return "eof", ""
            m = match(text, pos)
            if m is None:
                raise ProtoTextError(line(), f"unexpected character {text[pos]!r}")
            pos = m.end()
            if m.lastgroup != "ws":
                return m.lastgroup or "", m.group()

    def value(kind: str, tok: str) -> Scalar:
        if kind == "str":
            parts = [tok]
            while True:  # adjacent quoted strings concatenate
                save = pos_get()
                k2, t2 = token()
                if k2 != "str":
                    pos_set(save)
                    break
                parts.append(t2)
            try:
                return "".join(unescape(p[1:-1]) for p in parts)
            except ValueError as exc:
                raise ProtoTextError(line(), str(exc)) from None
        if kind in ("num", "id"):
            return _scalar(kind, tok)
        raise ProtoTextError(line(), f"expected a value, got {tok or 'end of file'!r}")

    def pos_get() -> int:
        return pos

    def pos_set(p: int) -> None:
        nonlocal pos
        pos = p

    while True:
        kind, tok = token()
        if kind == "eof":
            if stack:
                raise ProtoTextError(line(), f"truncated: {len(stack)} block(s) not closed "
                                             f"(innermost {names[-1]!r})")
            return root
        if kind == "p" and tok in ",;":
            continue
        if kind == "p" and tok in "}>":
            if not stack or stack[-1][2] != tok:
                raise ProtoTextError(line(), f"unexpected {tok!r}")
            parent, name, _ = stack.pop()
            drop = on_close(names, current) if on_close else False
            if not drop:
                parent.fields.append((name, current))
            names.pop()
            current = parent
            continue
        if kind != "id" or tok.startswith("-"):
            raise ProtoTextError(line(), f"expected a field name, got {tok!r}")
        name = tok
        kind, tok = token()
        colon = kind == "p" and tok == ":"
        if colon:
            kind, tok = token()
        if kind == "p" and tok in "{<":
            if len(stack) >= max_depth:
                raise ProtoTextError(line(), f"nested deeper than {max_depth} blocks")
            stack.append((current, name, "}" if tok == "{" else ">"))
            names.append(name)
            current = Message()
            continue
        if not colon:
            raise ProtoTextError(line(), f"expected ':' or '{{' after {name!r}, got {tok or 'end of file'!r}")
        if kind == "p" and tok == "[":
            kind, tok = token()
            while not (kind == "p" and tok == "]"):
                if kind == "p" and tok == ",":
                    kind, tok = token()
                    continue
                current.fields.append((name, value(kind, tok)))
                kind, tok = token()
                if kind == "eof":
                    raise ProtoTextError(line(), f"truncated: list of {name!r} not closed")
            continue
        current.fields.append((name, value(kind, tok)))
