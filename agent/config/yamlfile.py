"""Safe loading of the operator's YAML files (config, rule files, rule tests, web config).

Every failure is a :class:`ConfigError` naming the file, whatever the text: invalid YAML, not
UTF-8, larger than ``MAX_YAML_BYTES``, nested deeper than ``MAX_YAML_DEPTH`` (PyYAML's scanner is
quadratic in flow nesting and its parser recursive), more than ``MAX_YAML_NODES`` values once
aliases are expanded (an alias bomb of a few hundred bytes holds billions), or integers of
thousands of digits. These limits were found by the fuzz suite (tests/fuzzing/test_fuzz.py).

``known``: texts parsed before, by the SHA-256 of their bytes, as JSON (the shipped rule files'
``parsed.json``, engine/rulefile.py): a file whose bytes are one of them is not parsed again, and
PyYAML (~0.03 s to import, ~0.1 MB/s to parse) is imported only when a file needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError

def load_yaml_mapping(path: Path, known: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Safe-load a YAML mapping; every failure becomes a ConfigError naming the file. ``known``:
    JSON texts of mappings by the SHA-256 of the file bytes they were parsed from (see above)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
        if len(raw) > MAX_YAML_BYTES:
            raise ConfigError(str(path), "(file)", f"larger than {MAX_YAML_BYTES >> 20} MiB")
        if known:
            import hashlib
            import json
            parsed = known.get(hashlib.sha256(raw).hexdigest())
            if parsed is not None:
                try:
                    data = json.loads(parsed)
                except ValueError:   # a damaged twin: parse the file itself
                    data = None
                if isinstance(data, dict):
                    return data
        text = raw.decode("utf-8")
    except OSError as exc:
        raise ConfigError(str(path), "(file)", exc.strerror or str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "(file)", f"not UTF-8 text: {exc.reason}") from exc
    if _flow_depth(text) > MAX_YAML_DEPTH:  # PyYAML's scanner is quadratic in it, then recurses
        raise ConfigError(str(path), "(yaml)", f"nested deeper than {MAX_YAML_DEPTH} levels")
    import yaml   # on use: see the module docstring
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "(yaml)"
        raise ConfigError(str(path), where, f"invalid YAML: {getattr(exc, 'problem', None) or exc}") from exc
    except RecursionError:
        raise ConfigError(str(path), "(yaml)", "invalid YAML: nested too deeply") from None
    except (ValueError, OverflowError) as exc:  # e.g. an integer of more than 4300 digits
        raise ConfigError(str(path), "(yaml)", f"invalid YAML value: {str(exc)[:200]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "(top level)", "expected a mapping of settings")
    _check_shape(str(path), data)
    return data


MAX_YAML_BYTES = 1 << 20     # thousands of rules; PyYAML reads ~100 KiB/s (the shipped files: a few KiB)
MAX_YAML_DEPTH = 32          # no setting, rule or rule test nests deeper than a few levels
MAX_YAML_NODES = 1_000_000   # values counted as often as aliases repeat them ("billion laughs")


def _flow_depth(text: str) -> int:
    """The deepest nesting of flow collections (``[`` and ``{`` outside quotes and comments),
    at most one past ``MAX_YAML_DEPTH``: a linear pre-check, as PyYAML takes seconds on a few
    hundred levels. Brackets inside plain scalars count too, which can only over-count a file
    that holds dozens of unclosed ones."""
    if text.count("[") + text.count("{") <= MAX_YAML_DEPTH:
        return 0
    depth = deepest = 0
    quote = ""
    comment = False
    for ch in text:
        if comment:
            comment = ch != "\n"
        elif quote:
            if ch == quote or ch == "\n" and quote == "#":
                quote = ""
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_YAML_DEPTH:
                    break
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            comment = True
    return deepest


def _check_shape(file: str, data: Any) -> None:
    """Refuse trees that validation would choke on: nesting beyond ``MAX_YAML_DEPTH`` (the
    validators and the error report recurse) and, through aliases, more values than
    ``MAX_YAML_NODES`` (an alias bomb of a few hundred bytes expands to billions). Iterative:
    the walk itself never recurses, and it stops at the first excess."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_YAML_NODES:
            raise ConfigError(file, "(yaml)", f"more than {MAX_YAML_NODES} values (YAML aliases repeating a "
                              "large structure?)")
        if isinstance(node, dict):
            children: Any = [*node.keys(), *node.values()]
        elif isinstance(node, (list, tuple, set)):
            children = node
        else:
            continue
        if depth >= MAX_YAML_DEPTH and children:
            raise ConfigError(file, "(yaml)", f"nested deeper than {MAX_YAML_DEPTH} levels")
        stack.extend((c, depth + 1) for c in children)
