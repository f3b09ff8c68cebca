"""Every configuration model of the agent, on one strict base (``base.Strict``):

* ``agent``: the agent's own config file (watches, limits, HTTP, state) and ``load_config``;
* ``alertmanager``: its ``alertmanager:`` section;
* ``rules``: rule files (``rules/*.yml`` and the user's);
* ``ruletest``: rule test files (``precision-agent rules test``);
* ``base``: the strict base, durations, sizes, label checks and the error report that names
  every problem; ``yamlfile``: the one safe YAML loader.

Rule kinds, parser formats and compare presets are plug-in registries owned by their stages;
the validators look them up when a value is checked, never at import, so every stage may import
this package. The names below are imported on first use (PEP 562): a command that needs one
model (``compare`` needs none) does not pay for building all of them at start.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import DEFAULT_LISTEN, DEFAULT_PORT, ConfigError

_LAZY = {
    "CompareSpec": "agent", "Config": "agent", "HttpSettings": "agent", "Limits": "agent", "Watch": "agent",
    "load_config": "agent", "split_listen": "agent",
    "AlertmanagerConfig": "alertmanager", "BasicAuth": "alertmanager",
    "Duration": "base", "LabelValue": "base", "Size": "base", "Strict": "base", "all_problems": "base",
    "check_labels": "base", "format_validation_error": "base", "label_value": "base", "parse_duration": "base",
    "parse_size": "base",
    "load_yaml_mapping": "yamlfile",
}

__all__ = ["DEFAULT_LISTEN", "DEFAULT_PORT", "ConfigError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value   # the next lookup is a plain global
    return value
