"""The base of every configuration model: one strict pydantic base, and the value types and
checks shared by the agent config, rule files, rule tests and the Alertmanager section
(durations, sizes, label names and values), with the error report that names every problem.

A bad config must stop the agent at start with the file, the field and the reason, because a
monitoring agent that silently runs with half a config is worse than one that refuses to start.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from ..errors import ConfigError

LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
RESERVED_LABELS = {"alertname", "alertstate", "severity", "metric", "__name__"}

_DURATION_RE = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)(ms|s|m|h|d))+\s*$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Any) -> float:
    """Seconds from a Prometheus-style duration ("30s", "1m30s", "500ms") or a number."""
    if isinstance(value, bool):
        raise ValueError("duration must be a number of seconds or a string such as '30s'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("duration must not be negative")
        return _finite(float(value) if isinstance(value, float) or abs(value) < 1 << 1023 else math.inf)
    if isinstance(value, str) and _DURATION_RE.match(value):
        return _finite(sum(float(n) * _UNIT[u] for n, u in _DURATION_PART.findall(value)))
    raise ValueError(f"invalid duration {value!r}: use e.g. 500ms, 30s, 5m, 1h")


def _finite(seconds: float) -> float:
    if not math.isfinite(seconds):
        raise ValueError("duration must be a finite number of seconds")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]

_SIZE_RE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_SIZE_UNIT = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30,
              "KB": 1000, "MB": 1000**2, "GB": 1000**3}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as '64MiB'."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(m.group(1)) * _SIZE_UNIT[m.group(2)]
    raise ValueError(f"invalid size {value!r}: use bytes or e.g. 512KiB, 64MiB")


Size = Annotated[int, BeforeValidator(parse_size)]


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    for key in labels:
        if not LABEL_NAME_RE.match(key) or key.startswith("__"):
            raise ValueError(f"label name {key!r} is not a valid Prometheus label name")
        if key in RESERVED_LABELS:
            raise ValueError(f"label name {key!r} is reserved by the agent")
    return {k: str(v) for k, v in labels.items()}


def label_value(v: Any) -> Any:
    """Label values are strings; accept YAML numbers and booleans (``rank: 0``) as written."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v) if isinstance(v, (int, float)) else v


LabelValue = Annotated[str, BeforeValidator(label_value)]


class Strict(BaseModel):
    """Every configuration model's base: unknown keys are errors, values are immutable, and a
    field with an alias (``for``) may also be given by its name."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


Problem = tuple[tuple, str, str]   # (location, pydantic error type, reason)


def _problems(err: ValidationError) -> list[Problem]:
    return [(tuple(e["loc"]), e["type"], e["msg"].removeprefix("Value error, ")) for e in err.errors()]


def _drop(data: Any, loc: tuple) -> tuple | None:
    """Remove from ``data`` the deepest mapping key on ``loc``; the location removed, or None."""
    node, deepest = data, None
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            deepest = (node, part, loc[:i + 1])
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            break
    if deepest is None:
        return None
    parent, key, where = deepest
    del parent[key]
    return where


def _masked(p: Problem, removed: list[tuple]) -> bool:
    """A problem the removal of a bad field made up: that field now missing, or a cross-field
    check that names it."""
    loc, kind, reason = p
    if kind == "missing" and loc in removed:
        return True
    return any(r[:len(loc)] == loc and len(r) > len(loc) and str(r[-1]) in reason for r in removed)


def all_problems(model: type[BaseModel], data: dict[str, Any], err: ValidationError,
                 rounds: int = 4) -> list[Problem]:
    """Every problem of ``data``, not only those pydantic reports in one go: a model whose
    fields fail never runs its cross-field checks, so the failing fields are taken out and the
    rest validated again, until nothing new shows."""
    problems = _problems(err)
    fresh, work, removed = problems, copy.deepcopy(data), []
    for _ in range(rounds):
        dropped = [r for r in (_drop(work, loc) for loc, _, _ in fresh) if r is not None]
        if not dropped:
            break
        removed += dropped
        try:
            model.model_validate(work)
            break
        except ValidationError as again:
            seen = {(loc, reason) for loc, _, reason in problems}
            fresh = [p for p in _problems(again) if (p[0], p[2]) not in seen and not _masked(p, removed)]
            problems += fresh
        except Exception:  # noqa: BLE001 - a validator surprised by a partial config: keep what we have
            break
    return problems


def format_validation_error(file: str, err: ValidationError,
                            problems: list[Problem] | None = None) -> ConfigError:
    listed = [(".".join(str(p) for p in loc) or "(top level)", reason)
              for loc, _, reason in (problems or _problems(err))]
    return ConfigError(file, listed[0][0], listed[0][1], problems=listed)

