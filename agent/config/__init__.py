"""Every configuration model of the agent, on one strict base (``base.Strict``):

* ``agent``: the agent's own config file (watches, limits, HTTP, state) and ``load_config``;
* ``alertmanager``: its ``alertmanager:`` section;
* ``rules``: rule files (``rules/*.yml`` and the user's);
* ``ruletest``: rule test files (``precision-agent rules test``);
* ``base``: the strict base, durations, sizes, label checks and the error report that names
  every problem; ``yamlfile``: the one safe YAML loader.

Rule kinds, parser formats and compare presets are plug-in registries owned by their stages;
the validators look them up when a value is checked, never at import, so every stage may import
this package.
"""

from ..errors import DEFAULT_LISTEN, DEFAULT_PORT, ConfigError
from .agent import CompareSpec, Config, HttpSettings, Limits, Watch, load_config, split_listen
from .alertmanager import AlertmanagerConfig, BasicAuth
from .base import (Duration, LabelValue, Size, Strict, all_problems, check_labels, format_validation_error,
                   label_value, parse_duration, parse_size)
from .yamlfile import load_yaml_mapping

__all__ = ["DEFAULT_LISTEN", "DEFAULT_PORT", "AlertmanagerConfig", "BasicAuth", "CompareSpec", "Config",
           "ConfigError", "Duration", "HttpSettings", "LabelValue", "Limits", "Size", "Strict", "Watch",
           "all_problems", "check_labels", "format_validation_error", "label_value", "load_config",
           "load_yaml_mapping", "parse_duration", "parse_size", "split_listen"]
