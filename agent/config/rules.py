"""Rule files: groups of rules, each an alert name, a kind, a match on labels, parameters,
severity, ``for``, annotations (templates checked here, rendered by engine/rulefile.py)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from ..model import SEVERITIES
from .base import Duration, Strict, check_labels
from .regex import UserRegex

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TEMPLATE_RE = re.compile(r"\{\{\s*\$([A-Za-z_]+)(?:\.([A-Za-z_][A-Za-z0-9_]*))?\s*\}\}")
_TEMPLATE_ROOTS = {"labels": True, "params": True, "evidence": True,
                   "value": False, "step": False, "file": False, "line": False, "alertname": False,
                   "runbook_base": False}


class Match(Strict):
    """Label matchers: RE2 regexes (as Prometheus), anchored at both ends; a missing label is \"\"."""

    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _regexes(cls, v: dict[str, str]) -> dict[str, str]:
        for key, pattern in v.items():
            UserRegex(pattern, f"label {key!r}")   # raises ValueError with the reason
        return v


class RuleSpec(Strict):
    alert: str
    kind: str
    match: Match = Field(default_factory=Match)
    params: dict[str, Any] = Field(default_factory=dict)
    for_: Duration = Field(0.0, alias="for")
    keep_firing_for: Duration = 0.0
    resolve_after: Duration | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("alert")
    @classmethod
    def _alert_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"alert name {v!r} must match {_NAME_RE.pattern}")
        return v

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        from ..detectors import KINDS  # the registry of rule kinds; looked up, not imported at load
        if v not in KINDS:
            raise ValueError(f"unknown rule kind {v!r}; known kinds: {', '.join(sorted(KINDS))}")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        sev = v.get("severity")
        if sev is None:
            raise ValueError("labels.severity is required")
        if sev not in SEVERITIES:
            raise ValueError(f"severity {sev!r} must be one of {', '.join(SEVERITIES)}")
        return check_labels({k: val for k, val in v.items() if k != "severity"}) | {"severity": sev}

    @field_validator("annotations")
    @classmethod
    def _templates(cls, v: dict[str, str]) -> dict[str, str]:
        for key, text in v.items():
            for m in TEMPLATE_RE.finditer(text):
                root, attr = m.group(1), m.group(2)
                if root not in _TEMPLATE_ROOTS:
                    raise ValueError(f"annotation {key!r}: unknown template variable ${root}")
                if _TEMPLATE_ROOTS[root] != (attr is not None):
                    raise ValueError(f"annotation {key!r}: ${root} " +
                                     ("needs a field, e.g. ${root}.name" if _TEMPLATE_ROOTS[root] else "takes no field"))
            if "{{" in TEMPLATE_RE.sub("", text):
                raise ValueError(f"annotation {key!r}: unsupported template expression")
        return v

    @model_validator(mode="after")
    def _params(self) -> "RuleSpec":
        from ..detectors import KINDS
        KINDS[self.kind].params_model.model_validate(self.params)  # raises with the field name
        return self


class Group(Strict):
    name: str
    rules: list[RuleSpec] = Field(default_factory=list)


class RuleFileModel(Strict):
    groups: list[Group]


