"""Detector memory as data: a small explicit JSON codec, and where a detector keeps its memory.

Why: detectors keep per-series windows (loss-scale decreases, a spike's history, the "active"
flag of a stateful alert). Without them a restart re-learns from nothing: a firing stateful
alert never clears, and a window in progress starts over (late alerts, re-pages). The memory is
written with the offsets and alerts, in the same transaction, so after a restart every detector
is where the last committed batch left it.

Nothing read back is executed (no pickle): the codec knows a fixed set of tags (tuple, deque,
dict, OrderedDict, non-finite floats, SourcePos, Sample, numeric numpy arrays), and a detector's
records are rebuilt by their own zero-argument factory with only their declared fields set,
each checked against the type of the field's default.

Rows are keyed by the rule's identity (file, group, alert) and a digest of what its memory means
(kind, params with defaults, label matchers, memory layout): a rule edited between runs starts
empty, a removed rule's rows are deleted. One row per (rule, PerSeries attribute, series), so a
batch rewrites only the series it touched (the bookkeeping is pipeline.py's MemoryBook).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import math
from collections import OrderedDict, deque
from typing import Any, Iterable

import numpy as np

from ..detectors.base import explicit, slots_of
from ..model import Labels, Sample, SourcePos
from ..engine.rulefile import Rule

# attribute names read with getattr and passed back as keywords: model.py's classes may change
# shape (dataclass or __slots__) without changing these
SOURCE_FIELDS = ("path", "line", "offset")
SAMPLE_FIELDS = ("labels", "metric", "value", "step", "source", "time", "log_time", "attrs", "producer")
WHOLE = "*"  # the slot of a detector's explicit state()


class CodecError(ValueError):
    """A value that cannot be stored, or stored data that does not decode."""


# -- codec ---------------------------------------------------------------------------------------
def encode(v: Any) -> Any:
    """``v`` as JSON-ready data; raises CodecError for a type the codec does not know."""
    if v is None or isinstance(v, (bool, str, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$f": "nan" if v != v else ("inf" if v > 0 else "-inf")}
    t = type(v)
    if t is list:
        if v and all(map(_plain_tuple, v)):  # windows of (step, count) kept in lists
            return {"$qt": [list(x) for x in v], "n": None}
        return _plain(v) or [encode(x) for x in v]
    if t is tuple:
        return {"$t": _plain(v) or [encode(x) for x in v]}
    if t is deque:
        if v and all(map(_plain_tuple, v)):  # windows of (step, count): the common case, kept cheap
            return {"$qt": [list(x) for x in v], "n": v.maxlen}
        return {"$q": _plain(v) or [encode(x) for x in v], "n": v.maxlen}
    if t is OrderedDict:
        return {"$o": [[encode(k), encode(x)] for k, x in v.items()]}
    if t is dict:
        if all(type(k) is str and not k.startswith("$") for k in v):
            return {k: encode(x) for k, x in v.items()}
        return {"$d": [[encode(k), encode(x)] for k, x in v.items()]}
    if t is SourcePos:
        return {"$p": [encode(getattr(v, n)) for n in SOURCE_FIELDS]}
    if t is Sample:
        return {"$s": {n: encode(getattr(v, n)) for n in SAMPLE_FIELDS}}
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "biuf":
            raise CodecError(f"cannot store an array of dtype {v.dtype}")
        return {"$a": v.dtype.str, "shape": list(v.shape),
                "b": base64.b64encode(np.ascontiguousarray(v).tobytes()).decode("ascii")}
    if isinstance(v, np.generic):
        return encode(v.item())
    raise CodecError(f"cannot store a {t.__name__}")


_PLAIN = frozenset({int, float, str, bool, type(None)})


def _plain(v: list | tuple | deque) -> list | None:
    """``v`` as a list when every item is JSON as it is (finite floats, ints, str, bool, None)."""
    if not v or not set(map(type, v)) <= _PLAIN:
        return None
    floats = [x for x in v if type(x) is float]
    return list(v) if all(map(math.isfinite, floats)) else None


def _plain_tuple(x: Any) -> bool:
    return type(x) is tuple and _plain(x) is not None


def decode(d: Any) -> Any:
    """The value ``encode`` made ``d`` from; raises CodecError for anything else."""
    if d is None or isinstance(d, (bool, int, float, str)):
        return d
    if isinstance(d, list):
        return [decode(x) for x in d]
    if not isinstance(d, dict):
        raise CodecError(f"unexpected {type(d).__name__}")
    tags = [k for k in d if k.startswith("$")]
    if not tags:
        return {k: decode(x) for k, x in d.items()}
    tag = tags[0]
    body = d[tag]
    try:
        if tag == "$f" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "$t":
            return tuple(decode(x) for x in _list(body))
        if tag in ("$q", "$qt"):
            n = d.get("n")
            if n is not None and (type(n) is not int or n < 0):
                raise CodecError(f"bad deque length {n!r}")
            # an unbounded window comes back as a list: the detectors keep their windows in lists
            # (an idle series' deque costs 760 bytes empty); stores written before still load
            make = list if n is None else (lambda items: deque(items, maxlen=n))
            if tag == "$qt":
                return make(tuple(_plain(_list(x)) or _bad("a tuple of scalars")) for x in _list(body))
            return make(decode(x) for x in _list(body))
        if tag in ("$o", "$d"):
            pairs = [(decode(k), decode(x)) for k, x in (_pair(p) for p in _list(body))]
            return OrderedDict(pairs) if tag == "$o" else dict(pairs)
        if tag == "$p":
            path, line, offset = _list(body)
            return SourcePos(path=_typed(path, str), line=_typed(line, int), offset=_typed(offset, int))
        if tag == "$s":
            return _sample(body)
        if tag == "$a":
            return _array(d)
    except TypeError as exc:  # e.g. an unhashable key
        raise CodecError(str(exc)) from exc
    raise CodecError(f"unknown or malformed tag {tag}")


def _bad(what: str) -> Any:
    raise CodecError(f"expected {what}")


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise CodecError(f"expected a list, got {type(v).__name__}")
    return v


def _pair(p: Any) -> tuple[Any, Any]:
    if not isinstance(p, list) or len(p) != 2:
        raise CodecError("expected a [key, value] pair")
    return p[0], p[1]


def _typed(v: Any, *types: type) -> Any:
    if type(v) not in types:
        raise CodecError(f"expected {'/'.join(t.__name__ for t in types)}, got {type(v).__name__}")
    return v


def _sample(body: Any) -> Sample:
    if not isinstance(body, dict) or set(body) != set(SAMPLE_FIELDS):
        raise CodecError("malformed sample")
    f = {n: decode(body[n]) for n in SAMPLE_FIELDS}
    labels = f["labels"]
    if not isinstance(labels, tuple) or not all(isinstance(p, tuple) and len(p) == 2
                                                and type(p[0]) is str and type(p[1]) is str for p in labels):
        raise CodecError("malformed sample labels")
    _typed(f["metric"], str)
    _typed(f["value"], float, int)
    _typed(f["step"], int, type(None))
    _typed(f["source"], SourcePos)
    _typed(f["time"], float, int)
    _typed(f["log_time"], float, int, type(None))
    _typed(f["producer"], str)
    if not isinstance(f["attrs"], tuple) or not all(isinstance(p, tuple) and len(p) == 2 and type(p[0]) is str
                                                    for p in f["attrs"]):
        raise CodecError("malformed sample attrs")
    return Sample(**f)


def _array(d: dict[str, Any]) -> np.ndarray:
    try:
        dtype = np.dtype(_typed(d["$a"], str))
    except TypeError as exc:
        raise CodecError(f"bad dtype {d['$a']!r}") from exc
    shape = tuple(_typed(x, int) for x in _list(d.get("shape")))
    if dtype.kind not in "biuf" or any(x < 0 for x in shape):
        raise CodecError(f"bad array {dtype} {shape}")
    raw = base64.b64decode(_typed(d.get("b"), str), validate=True)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise CodecError("array size does not match its shape")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


# -- records (a PerSeries' values) -------------------------------------------------------------
def record_fields(cls: Any) -> tuple[str, ...] | None:
    """The fields of a detector's record class (dataclass or __slots__); None for a container."""
    if not isinstance(cls, type):
        return None
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    names: list[str] = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
    return tuple(names) or None


def encode_record(factory: Any, value: Any) -> Any:
    fields = record_fields(factory)
    if fields is None:
        return encode(value)
    return {n: encode(getattr(value, n)) for n in fields}


def decode_record(factory: Any, data: Any) -> Any:
    """A fresh ``factory()`` with the stored fields set; every field must have its default's type."""
    fresh = factory()
    fields = record_fields(factory)
    if fields is None:
        value = decode(data)
        if type(value) is not type(fresh):
            raise CodecError(f"expected {type(fresh).__name__}, got {type(value).__name__}")
        return value
    if not isinstance(data, dict):
        raise CodecError("a record must be an object")
    hints = {f.name: str(f.type) for f in dataclasses.fields(factory)} if dataclasses.is_dataclass(factory) else {}
    for name in fields:
        if name in data:
            value = decode(data[name])
            _check_like(getattr(fresh, name), value, name, hints.get(name, ""))
            setattr(fresh, name, value)
    return fresh


_HINTS: dict[str, tuple[type, ...]] = {"float": (float, int), "int": (int,), "bool": (bool,), "str": (str,),
                                       "None": (type(None),), "SourcePos": (SourcePos,),
                                       "np.ndarray": (np.ndarray,)}
_SCALARS = (type(None), int, float, str, SourcePos)


def _check_like(default: Any, value: Any, name: str, hint: str) -> None:
    """A restored field must look like its default (or, where that is None, like its annotation:
    a simple union of scalars; else any scalar), so a tampered row cannot plant a wrong type."""
    if default is None:
        parts = [p.strip() for p in hint.split("|")] if hint else []
        if parts and all(p in _HINTS for p in parts):
            allowed = tuple(t for p in parts for t in _HINTS[p])
        else:
            allowed = _SCALARS
        if type(value) not in allowed:
            raise CodecError(f"field {name}: unexpected {type(value).__name__}")
        return
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        ok = type(value) is type(default)
    else:  # a float field may hold an int; neither may hold a bool
        ok = type(value) is int or (type(value) is float and isinstance(default, float))
    if not ok:
        raise CodecError(f"field {name}: expected {type(default).__name__}, got {type(value).__name__}")


# -- where a detector keeps its memory -----------------------------------------------------------
def digest(rule: Rule) -> str:
    """What the rule's memory means: kind, parameters (with defaults), matchers, memory layout."""
    det = rule.detector
    layout = sorted((slot, getattr(ps.factory, "__qualname__", str(ps.factory)), record_fields(ps.factory))
                    for slot, ps in slots_of(det).items())
    raw = json.dumps({"kind": rule.spec.kind, "class": type(det).__qualname__,
                      "params": det.params.model_dump(mode="json"), "match": rule.spec.match.labels,
                      "layout": layout, "explicit": explicit(det)}, sort_keys=True, default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def rule_keys(rules: Iterable[Rule]) -> list[tuple[Rule, str]]:
    """Each rule's identity: file, group and alert name (numbered when one file repeats them)."""
    seen: dict[str, int] = {}
    out = []
    for r in rules:
        key = f"{r.file}|{r.group}|{r.name}"
        n = seen[key] = seen.get(key, 0) + 1
        out.append((r, key if n == 1 else f"{key}#{n}"))
    return out


@functools.lru_cache(maxsize=1024)  # the series written often (an idle one is written when it changes)
def dump_key(labels: Labels) -> str:
    return _JSON.encode([list(p) for p in labels])


def load_key(raw: str) -> Labels:
    pairs = json.loads(raw)
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2
                                              and all(type(x) is str for x in p) for p in pairs):
        raise CodecError(f"bad series key {raw[:80]!r}")
    return tuple((k, v) for k, v in pairs)


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # one encoder: json.dumps builds one per call


def dumps(data: Any) -> str:
    return _JSON.encode(data)


def loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"not JSON ({exc})") from exc
