"""Fuzz targets of the operator's files: rule files, the config file, `rules test` files.

Each case is a YAML text: a real file's tree with hostile edits (wrong types, deep nesting, huge
strings, bad regexes and templates), dumped, then sometimes damaged as text (YAML aliases,
tags, tabs, truncation, nesting thousands deep). The loaders document ``ConfigError`` only.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import yaml

from precision_agent.config import ConfigError, load_config
from precision_agent.model import SourcePos, make_labels
from precision_agent.engine.rulefile import default_rules_dir, load_rule_file
from precision_agent.commands.ruletest import run_file

from .core import Target
from .mutate import mutate_text, mutate_tree, pick

YAML_BAIT = ["&a ", "*a", "<<: *a", "!!python/object/apply:os.system ['true']", "!!binary AAAA", "!!float nan",
             "? ", "- ", ": ", "{", "}", "[", "]", "\t", "%YAML 1.1\n", "---\n", "...\n", "|\n  ", ">-\n  ", "'", '"',
             "\\u0000", "!!set {a}", "!!timestamp 2024-01-01", "0o777", "0x_ff", "1_0", ".inf", "~", "null", "\ufeff"]
RULE_KEYS = ["groups", "name", "rules", "alert", "kind", "match", "labels", "params", "for", "annotations",
             "summary", "severity", "resolve_after", "description"]
CONFIG_KEYS = ["listen", "watches", "path", "kind", "format", "pattern", "labels", "limits", "http", "digest",
               "compare", "against", "max_line_bytes", "max_series", "state_dir", "rule_dirs", "alertmanager",
               "urls", "series_ttl", "debounce", "poll", "poll_interval", "include", "exclude", "run_from"]
BASE_CONFIG: dict[str, Any] = {
    "listen": "127.0.0.1:19400", "state_dir": "/tmp/x", "rule_dirs": [], "default_rules": True,
    "resync_interval": "30s", "evaluation_interval": "1s", "debounce": "50ms", "series_ttl": "24h",
    "log_level": "info",
    "http": {"max_connections": 512, "workers": 4, "header_timeout": "10s", "max_header_bytes": "16KiB"},
    "watches": [{"path": "/tmp/logs", "kind": "log", "recursive": True, "include": ["*.log"], "format": "auto",
                 "labels": {"job": "gpt3", "run": "r7"}, "run_from": "file", "poll": "auto"},
                {"path": "/tmp/dumps", "kind": "dump", "digest": r"^Functional\.linear\.\d+\.forward input\[1\]$",
                 "compare": {"against": "/tmp/other", "mode": "benchmark", "preset": "strict"}},
                {"path": "/tmp/custom", "format": "custom", "pattern": r"step (?P<step>\d+) loss (?P<loss>\S+)"}],
    "limits": {"max_line_bytes": "1MiB", "read_chunk_bytes": "1MiB", "max_series": 512, "nice": 10},
    "alertmanager": {"urls": ["http://127.0.0.1:9093"], "resend_interval": "1m"},
}
_RULES: list[dict[str, Any]] = []
_TESTS: dict[str, Any] = {}


def _shipped_rules() -> list[dict[str, Any]]:
    if not _RULES:
        for f in sorted(default_rules_dir().glob("*.yml")):
            for g in yaml.safe_load(f.read_text())["groups"]:
                _RULES.extend(g["rules"])
    return _RULES


def _damage(rng: random.Random, tree: Any, keys: list[str]) -> str:
    if rng.random() < 0.85:
        tree = mutate_tree(rng, tree, keys)
    try:
        text = yaml.safe_dump(tree, allow_unicode=rng.random() < 0.5, sort_keys=False)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        text = f"# not representable: {type(exc).__name__}\n"
    r = rng.random()
    if r < 0.3:
        text = mutate_text(rng, text, YAML_BAIT)
    elif r < 0.32:  # nesting far beyond any recursion limit
        text = "groups: " + rng.choice(("[", "{a: ", "- ")) * rng.choice((40, 500, 5000)) + "x\n"
    elif r < 0.35:   # an alias bomb: 9 levels of 9 references
        text = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 9)}]\n" for i in range(1, 10)) + "groups: *a9\n"
    return text


def _make_rules(rng: random.Random) -> str:
    rules = [dict(pick(rng, _shipped_rules())) for _ in range(rng.randint(1, 3))]
    return _damage(rng, {"groups": [{"name": "fuzz", "rules": rules}]}, RULE_KEYS)


def _run_rules(text: str, work: Path) -> None:
    path = work / "rules.yml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    for rule in load_rule_file(path):   # a rule that loads must also match and annotate
        labels = make_labels({"job": "x" * 300, "run": "\x00é", "rank": "3"})
        rule.matches(labels)
        rule.annotate(labels, float("nan"), 2 ** 70, SourcePos("/x.log", 1, 0),
                      {"tensor": "output[0]", "value": float("inf"), "nested": {"a": [1]}})


def _make_config(rng: random.Random) -> str:
    return _damage(rng, BASE_CONFIG, CONFIG_KEYS)


def _run_config(text: str, work: Path) -> None:
    path = work / "config.yml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    load_config(path)


def _shipped_tests() -> dict[str, Any]:
    if not _TESTS:
        doc = yaml.safe_load((default_rules_dir() / "tests" / "training_test.yml").read_text())
        _TESTS.update(doc, rule_files=[str(default_rules_dir() / "training.yml")], tests=doc["tests"][:3])
    return _TESTS


def _make_ruletest(rng: random.Random) -> str:
    keys = ["rule_files", "evaluation_interval", "tests", "name", "labels", "input_samples", "metric", "value",
            "step", "at", "attrs", "alert_rule_test", "eval_time", "alertname", "exp_alerts", "exp_labels", "log",
            "dumps", "path"]
    return _damage(rng, _shipped_tests(), keys)


def _run_ruletest(text: str, work: Path) -> None:
    path = work / "case_test.yml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    status = run_file(path, out=io.StringIO())
    if status not in (0, 1, 2):
        raise AssertionError(f"exit status {status}")


TARGETS = [
    Target("rule_files", _make_rules, _run_rules, (ConfigError,)),
    Target("config", _make_config, _run_config, (ConfigError,)),
    Target("rules_test", _make_ruletest, _run_ruletest),
]
