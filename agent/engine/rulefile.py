"""Rule files: shaped like Prometheus rule files, validated by pydantic, safe to template.

```yaml
groups:
  - name: loss-scale
    rules:
      - alert: LossScaleAtFloor
        kind: loss_scale            # which detector judges the data
        match: {labels: {run: "gpt-.*"}}   # optional: anchored RE2 regexes on series labels
        params: {floor: 1}          # the kind's own parameters, validated by the kind
        for: 0s
        labels: {severity: page}
        annotations:
          summary: "Loss scale {{ $value }} on {{ $labels.run }}"
```
Templates only substitute ``{{ $labels.X }}``, ``{{ $value }}``, ``{{ $step }}``, ``{{ $params.X }}``,
``{{ $evidence.X }}``, ``{{ $file }}``, ``{{ $line }}``, ``{{ $alertname }}`` and ``{{ $runbook_base }}``
(the config's ``runbook_base_url``; default: the runbooks shipped with the package): nothing in a rule
file is ever executed. A bad file is reported with its file, rule and field; the loader keeps the
last good version of that file.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from ..config import ConfigError, load_yaml_mapping
from ..config.regex import UserRegex
from ..config.rules import TEMPLATE_RE, RuleFileModel, RuleSpec
from ..detectors import KINDS, Detector
from ..model import Labels, SourcePos

log = logging.getLogger(__name__)

# "at step {{ $step }}", "since step {{ $evidence.since_step }}": dropped whole where that value
# is missing, not left as "at step "
_STEP_PHRASE = re.compile(r"[ \t]*(?:\b(?:at|on|from|in|of|after|before|since|until)[ \t]+)?\b(?:step|iteration)s?"
                          r"[ \t]+\{\{\s*\$([A-Za-z_]+)(?:\.([A-Za-z_][A-Za-z0-9_]*))?\s*\}\}")
_EMPTY_PARENS = re.compile(r"[ \t]*\(\s*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"[ \t]+([,.;:])(?=\s|$)")


def _lookup(ctx: Mapping[str, Any], root: str, attr: str | None) -> Any:
    val = ctx.get(root)
    if attr is not None:
        val = val.get(attr) if isinstance(val, Mapping) else None
    return val


def render(template: str, ctx: Mapping[str, Any]) -> str:
    """Fill a validated annotation template; a missing value renders as an empty string, and a
    missing step takes the words that introduce it along ("NaN in loss at step " -> "NaN in loss")."""
    if "step" in template or "iteration" in template:
        dropped = _STEP_PHRASE.sub(lambda m: "" if _lookup(ctx, m.group(1), m.group(2)) is None else m.group(0),
                                   template)
        if dropped != template:
            template = _SPACE_BEFORE_PUNCT.sub(r"\1", _EMPTY_PARENS.sub("", dropped))

    def sub(m: re.Match[str]) -> str:
        val = _lookup(ctx, m.group(1), m.group(2))
        if val is None:
            return ""
        if isinstance(val, float):
            return format(val, ".6g")
        return str(val)
    return TEMPLATE_RE.sub(sub, template)


@dataclass
class Rule:
    """A validated rule with its own detector instance (detector state is per rule)."""

    spec: RuleSpec
    file: str
    group: str
    detector: Detector
    matchers: tuple[tuple[str, UserRegex], ...]
    resolve_after: float
    metrics: frozenset[str] = field(default_factory=frozenset)
    runbook_base: str = ""   # {{ $runbook_base }}: the config's runbook_base_url, or default_runbook_base()

    @property
    def name(self) -> str:
        return self.spec.alert

    @property
    def severity(self) -> str:
        return self.spec.labels["severity"]

    def matches(self, labels: Labels) -> bool:
        if not self.matchers:
            return True
        d = dict(labels)
        return all(p.fullmatch(d.get(k, "")) for k, p in self.matchers)

    def annotate(self, labels: Labels, value: float | None, step: int | None,
                 source: SourcePos | None, evidence: Mapping[str, Any]) -> dict[str, str]:
        ctx = {"labels": dict(labels), "value": value, "step": step, "params": self.detector.params.model_dump(),
               "evidence": evidence, "file": source.path if source else None,
               "line": source.line if source else None, "alertname": self.name,
               "runbook_base": self.runbook_base or default_runbook_base()}
        return {k: render(v, ctx) for k, v in self.spec.annotations.items()}


def build_rule(spec: RuleSpec, file: str, group: str, runbook_base: str = "") -> Rule:
    cls = KINDS[spec.kind]
    det = cls(cls.params_model.model_validate(spec.params))
    return Rule(spec, file, group, det,
                tuple((k, UserRegex(v, f"label {k!r}")) for k, v in spec.match.labels.items()),
                spec.resolve_after if spec.resolve_after is not None else cls.default_resolve_after,
                det.wanted_metrics(), runbook_base)


def _error_location(data: Any, loc: tuple[Any, ...]) -> str:
    """Turn pydantic's location into 'group "g" rule "R": field x.y'."""
    parts: list[str] = []
    node = data
    rest = list(loc)
    try:
        if rest[:1] == ["groups"] and len(rest) >= 2:
            group = node["groups"][rest[1]]
            parts.append(f'group "{group.get("name", rest[1])}"')
            rest = rest[2:]
            if rest[:1] == ["rules"] and len(rest) >= 2:
                rule = group["rules"][rest[1]]
                parts.append(f'rule "{rule.get("alert", rest[1])}"')
                rest = rest[2:]
    except (KeyError, IndexError, TypeError, AttributeError):
        pass
    fieldname = ".".join(str(p) for p in rest if not str(p).startswith("function-")) or "(rule)"
    return " ".join(parts + [f"field {fieldname}"])


PARSED = "parsed.jsonl"   # beside the shipped rule files: each one's parse, by the SHA-256 of its bytes


@functools.cache
def shipped_parsed() -> dict[str, str]:
    """The shipped rule files parsed at build time (``rules/parsed.jsonl``: a line per file,
    ``SHA-256 NAME JSON``, made by ``python -m tests.support.rule_twin``; tests/engine/test_rule_twin.py
    keeps it equal to the YAML): JSON text by the SHA-256 of the file. A file whose bytes match
    (a shipped one, or a copy) is validated from it without PyYAML, whose pure-Python parse of
    the shipped files was the largest part of a one-shot command's rule loading; any other
    file, or a shipped one edited since, is parsed as YAML. Empty where the twin is missing."""
    try:
        text = (default_rules_dir() / PARSED).read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and len(parts[0]) == 64:   # a damaged line: that file is parsed as YAML
            out[parts[0]] = parts[2]
    return out


def load_rule_file(path: Path, runbook_base: str = "") -> list[Rule]:
    """Parse and validate one rule file; raises ConfigError(file, where, reason)."""
    data = load_yaml_mapping(path, shipped_parsed())
    try:
        model = RuleFileModel.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        reason = first["msg"].removeprefix("Value error, ")
        ctx_err = first.get("ctx", {}).get("error")
        if isinstance(ctx_err, ValidationError):  # a kind's params error, re-raised inside a validator
            inner = ctx_err.errors()[0]
            reason = f"params.{'.'.join(map(str, inner['loc']))}: {inner['msg']}"
        raise ConfigError(str(path), _error_location(data, first["loc"]), reason) from exc
    rules: list[Rule] = []
    for group in model.groups:
        for spec in group.rules:
            rules.append(build_rule(spec, str(path), group.name, runbook_base))
    return rules


def default_rules_dir() -> Path:
    return Path(str(resources.files("precision_agent.rules")))


@functools.cache
def default_runbook_base() -> str:
    """file:// URL of the runbooks: docs/runbooks of a source checkout (the package folder is
    agent/ there), else the installed copy (package data ``precision_agent.runbooks``)."""
    package = Path(__file__).resolve().parents[1]
    return (package.parent / "docs" / "runbooks" if package.name == "agent" else package / "runbooks").as_uri()


def rule_files(dirs: list[Path]) -> list[Path]:
    """All *.yml / *.yaml files of the given directories (or files), sorted for stable order."""
    out: list[Path] = []
    for d in dirs:
        if d.is_file():
            out.append(d)
        elif d.is_dir():
            out.extend(sorted(p for p in d.iterdir() if p.suffix in (".yml", ".yaml") and p.is_file()))
        else:
            raise ConfigError(str(d), "(path)", "rule directory does not exist")
    return out


@dataclass
class RuleSet:
    """The rules in force, indexed by metric, with the last good version of every file."""

    by_file: dict[str, list[Rule]] = field(default_factory=dict)
    errors: dict[str, ConfigError] = field(default_factory=dict)
    _by_metric: dict[str, list[Rule]] = field(default_factory=dict)

    @property
    def rules(self) -> list[Rule]:
        return [r for rules in self.by_file.values() for r in rules]

    def rules_for(self, metric: str) -> list[Rule]:
        return self._by_metric.get(metric, [])

    def rule(self, name: str) -> list[Rule]:
        return [r for r in self.rules if r.name == name]

    def fresh(self) -> "RuleSet":
        """The same rules with new detector instances (no memory of earlier data)."""
        rs = RuleSet({f: [build_rule(r.spec, r.file, r.group, r.runbook_base) for r in rules]
                      for f, rules in self.by_file.items()},
                     dict(self.errors))
        rs.reindex()
        return rs

    def reindex(self) -> None:
        idx: dict[str, list[Rule]] = {}
        for r in self.rules:
            for m in r.metrics:
                idx.setdefault(m, []).append(r)
        self._by_metric = idx


def load_rules(dirs: list[Path], previous: RuleSet | None = None, runbook_base: str = "") -> RuleSet:
    """Load every rule file. A bad file keeps its previous good version (if any) and is
    reported in ``errors``; unchanged good files keep their detector state. ``runbook_base``
    fills ``{{ $runbook_base }}`` (empty: ``default_runbook_base()``)."""
    rs = RuleSet()
    for path in rule_files(dirs):
        key = str(path)
        try:
            rules = load_rule_file(path, runbook_base)
        except ConfigError as exc:
            rs.errors[key] = exc
            if previous is not None and key in previous.by_file:
                rs.by_file[key] = previous.by_file[key]
            continue
        if previous is not None and key in previous.by_file:
            old = previous.by_file[key]
            if [(r.spec, r.runbook_base) for r in old] == [(r.spec, r.runbook_base) for r in rules]:
                rules = old  # same rules: keep detector state
        rs.by_file[key] = rules
    rs.reindex()
    return rs
