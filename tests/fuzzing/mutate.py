"""Hostile mutations of text, bytes and parsed YAML/JSON structures (all driven by one rng)."""

from __future__ import annotations

import random
import re
from typing import Any

NUMBERS = ["nan", "NaN", "-nan", "NAN", "nan(0x7ff)", "inf", "-inf", "Infinity", "-Infinity", "INF", "1e309",
           "-1e309", "1e-400", "-0.0", "0x1p3", "1_000", "١٢٣", "１２３", "9" * 400, "-" + "9" * 40, "0" * 300 + "1",
           "1.2.3", "1e", "e5", ".", "-", "+", "1,5", "1e+", "18446744073709551616", "-9223372036854775809",
           "3.4028235e+39", "65504", "65536.0", "4.9e-324", "nan%", "1/0", "None", "null", "true", ""]
JUNK = ["\x00", "\r", "\r\n", "\n", "\t", "\x1b[31m", "\x1b[0m", "\x1b[2K\r", "\x1b]0;title\x07", "\ufeff",
        "\u202e", "\u200b", "\u0301", "\ud7ff", "\U0001f525", "\xa0", "\u2028", "\u3000", "\x7f", "\\", "'", '"',
        "{", "}", "[", "]", "|", ":", "=", ",", "%", "$", "{{", "}}", "\x85", "\x0c", "\x0b"]
# The largest text a generator makes (characters): `make test` keeps cases small enough for
# ten thousand in a minute, where a quadratic scan still takes seconds (32 KiB: ~10^9 steps);
# the bench raises it (python -m bench.fuzz --text-max).
TEXT_MAX = 1 << 15


def set_text_max(n: int) -> None:
    global TEXT_MAX
    TEXT_MAX = n


_NUM_RE = re.compile(r"[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf", re.I)


def pick(rng: random.Random, seq: list[Any]) -> Any:
    return seq[rng.randrange(len(seq))]


def mutate_text(rng: random.Random, s: str, fragments: list[str], max_len: int | None = None) -> str:
    """One or a few hostile edits of ``s``; the result stays under ``max_len`` characters
    (default ``TEXT_MAX``)."""
    max_len = TEXT_MAX if max_len is None else min(max_len, TEXT_MAX)
    for _ in range(rng.choice((1, 1, 2, 3, 5))):
        op = rng.randrange(13)
        n = len(s)
        at = rng.randint(0, n)
        if op == 0 and n:                              # truncate
            s = s[:at]
        elif op == 1:                                  # swap a number for a hostile one
            nums = list(_NUM_RE.finditer(s))
            if nums:
                m = pick(rng, nums)
                s = s[:m.start()] + pick(rng, NUMBERS) + s[m.end():]
        elif op == 2:                                  # control bytes, unicode, ANSI
            s = s[:at] + "".join(pick(rng, JUNK) for _ in range(rng.randint(1, 4))) + s[at:]
        elif op == 3:                                  # a real fragment of another shape
            s = s[:at] + pick(rng, fragments) + s[at:]
        elif op == 4 and n:                            # repeat a slice many times (giant lines)
            a = rng.randint(0, n - 1)
            piece = s[a:a + rng.randint(1, 40)]
            s = s[:at] + piece * rng.choice((2, 10, 200, 5000, 30000)) + s[at:]
        elif op == 5:                                  # a fragment repeated: backtracking bait
            s = s[:at] + pick(rng, fragments) * rng.choice((3, 50, 2000)) + s[at:]
        elif op == 6 and n:                            # delete a range
            s = s[:at] + s[at + rng.randint(1, 30):]
        elif op == 7 and n:                            # flip characters
            chars = list(s)
            for _ in range(rng.randint(1, 8)):
                chars[rng.randrange(len(chars))] = chr(rng.choice((rng.randrange(32, 127), rng.randrange(0, 0x3000))))
            s = "".join(chars)
        elif op == 8:                                  # a long run of one character
            s = s[:at] + rng.choice(" .0-9|:=\t([{'\"") * rng.choice((100, 5000, 60000)) + s[at:]
        elif op == 9:                                  # newlines dropped: records glued together
            s = s.replace("\n", rng.choice(("", " ", "\r", "\x00")))
        elif op == 10:                                 # a huge number in place of a digit run
            s = re.sub(r"\d+", lambda m: "9" * rng.choice((20, 400, 5000)), s, count=rng.randint(1, 3))
        elif op == 12 and n:                           # a record's head glued to itself: scan bait
            head = s[:rng.randint(8, 90)]
            s = head * rng.choice((20, 2000, 20000)) + s
        else:                                          # case and spacing games
            s = s.upper() if rng.random() < 0.5 else s.replace(" ", rng.choice(("", "  ", "\t", "\xa0")))
    return s[:max_len]


def mutate_bytes(rng: random.Random, b: bytes, hot: int = 64) -> bytes:
    """Byte-level damage, mostly in the first ``hot`` bytes (headers) but anywhere too."""
    buf = bytearray(b)
    for _ in range(rng.choice((1, 1, 2, 4))):
        op = rng.randrange(7)
        n = len(buf)
        if op == 0 and n:                               # truncate
            del buf[rng.randint(0, n - 1):]
        elif op == 1 and n:                             # flip bits in the header
            for _ in range(rng.randint(1, 6)):
                i = rng.randrange(min(n, hot) if rng.random() < 0.7 else n)
                buf[i] ^= 1 << rng.randrange(8)
        elif op == 2 and n:                             # overwrite a field with an extreme value
            i = rng.randrange(min(n, hot) if rng.random() < 0.7 else n)
            v = pick(rng, [b"\xff" * 8, b"\x00" * 8, b"\x7f\xff\xff\xff", b"\x80\x00\x00\x00", b"\xff\xff\xff\x7f",
                           b"\x01\x00\x00\x00\x00\x00\x00\x01"])
            buf[i:i + len(v)] = v
        elif op == 3:                                   # append garbage
            buf += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        elif op == 4 and n:                             # insert garbage
            i = rng.randrange(n)
            buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == 5 and n:                             # delete a range
            i = rng.randrange(n)
            del buf[i:i + rng.randint(1, 32)]
        else:                                           # random bytes of the same size
            buf = bytearray(rng.randrange(256) for _ in range(min(n, 4096)))
    return bytes(buf)


HOSTILE_VALUES: list[Any] = [None, True, False, 0, -1, 2 ** 63, -(2 ** 64), 10 ** 400, 1e308, -1e-320,
                             float("nan"), float("inf"), "", " ", "x" * 100_000, "\x00", "\U0001f525" * 50,
                             "(", "[a-", "a{99999999999}", "(?P<x>", "(a+)+$", "\\", "{{", "{{ $labels. }}",
                             "{{ $evidence.__class__ }}", "{{ $value | printf }}", "{{ {{ $value }} }}",
                             "{{ $labels.__init__.__globals__ }}", "${HOME}", "1e999s", "-5m", "30d", "0s",
                             "99999999999999h", "NaN", "512 ZiB", "-1KiB", "0.0.0.0:99999", "[::1]:80", "../..",
                             "/etc/passwd", "/dev/zero", "/proc/self/mem", [], {}, [[]], {"": None}, [None] * 50,
                             {"a": {"b": {"c": {}}}}, ["x"] * 1000]


def nested(rng: random.Random, depth: int) -> Any:
    v: Any = rng.choice((1, "x", None))
    for _ in range(depth):
        v = [v] if rng.random() < 0.5 else {"k": v}
    return v


def mutate_tree(rng: random.Random, node: Any, keys: list[str], edits: int = 0) -> Any:
    """A copy of a YAML/JSON tree with a few nodes replaced, removed, duplicated or retyped."""
    import copy
    root = copy.deepcopy(node)
    for _ in range(edits or rng.choice((1, 1, 2, 3, 6))):
        path: list[Any] = []
        cur = root
        while isinstance(cur, (dict, list)) and cur and rng.random() < 0.75:  # walk down a random path
            k = pick(rng, list(cur.keys())) if isinstance(cur, dict) else rng.randrange(len(cur))
            path.append(k)
            cur = cur[k]
        parent = root
        for k in path[:-1]:
            parent = parent[k]
        op = rng.randrange(6)
        new: Any
        if op == 0:
            new = pick(rng, HOSTILE_VALUES)
        elif op == 1:
            new = nested(rng, rng.choice((5, 60, 400)))
        elif op == 2:
            new = [cur] * rng.choice((2, 50)) if rng.random() < 0.5 else {pick(rng, keys): cur}
        elif op == 3:
            new = str(cur) if not isinstance(cur, str) else rng.choice((1, 1.5, [cur], {cur[:20]: cur}))
        elif op == 4 and isinstance(cur, dict):   # an unknown or known key added
            new = dict(cur)
            new[pick(rng, keys + ["__class__", "unknown_key", "0", ""])] = pick(rng, HOSTILE_VALUES)
        else:
            new = None
            if path and rng.random() < 0.6:         # delete the node
                if isinstance(parent, dict):
                    parent.pop(path[-1], None)
                else:
                    parent.pop(path[-1])
                continue
        if not path:
            root = new
        else:
            parent[path[-1]] = new
    return root
