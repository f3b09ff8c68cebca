"""Rule test files (``precision-agent rules test``): typed input samples, log files or dump
directories, and the alerts expected at given times, in promtool's shape. The runner is
commands/ruletest.py."""

from __future__ import annotations

import functools

from pydantic import Field, field_validator, model_validator

from .base import Duration, LabelValue, Strict, check_labels


@functools.cache
def known_metrics() -> frozenset[str]:
    """Every metric a rule kind reads or a parser produces (the registries, looked up on use)."""
    from ..detectors import KINDS
    from ..model import SKIPPED_CUMULATIVE, SKIPPED_INTERVAL, TRAINING_METRICS
    return frozenset().union(*(k.metrics for k in KINDS.values()), TRAINING_METRICS,
                             {SKIPPED_INTERVAL, SKIPPED_CUMULATIVE})


LabelMap = dict[str, LabelValue]  # YAML numbers and booleans (`rank: 0`) taken as written


class InputSample(Strict):
    """One typed sample, as a parser would have produced it (like promtool's input_series)."""
    metric: str
    value: float
    step: int | None = None
    at: Duration | None = None               # default: its index × the test's interval
    labels: LabelMap = Field(default_factory=dict)  # added to the test's labels (e.g. rank)
    attrs: dict[str, str | int | float | bool | None] = Field(default_factory=dict)

    @field_validator("metric")
    @classmethod
    def _known(cls, v: str) -> str:
        known = known_metrics()
        if v not in known:
            raise ValueError(f"unknown metric {v!r}; known: {', '.join(sorted(known))}")
        return v


class DumpInput(Strict):
    """A tensor-dump directory (or file), scanned by the real scanner as a dump watch would."""
    path: str                                # relative to the test file
    at: Duration = 0.0
    step: int | None = None                  # only this step, like `scan --step`


class ExpectedAlert(Strict):
    exp_labels: LabelMap = Field(default_factory=dict)
    exp_annotations: dict[str, str] | None = None  # only the keys given are compared


class AlertRuleTest(Strict):
    eval_time: Duration
    alertname: str
    exp_alerts: list[ExpectedAlert] = Field(default_factory=list)


class RuleTest(Strict):
    name: str
    labels: LabelMap = Field(default_factory=dict)    # the watch's labels
    format: str = "auto"
    pattern: str | None = None
    log: str | None = None
    log_name: str = "train.log"                     # what {{ $file }} renders for log lines
    input_samples: list[InputSample] = Field(default_factory=list)
    dumps: list[DumpInput] = Field(default_factory=list)
    interval: Duration | None = None                # default: evaluation_interval
    alert_rule_test: list[AlertRuleTest] = Field(min_length=1)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)

    @model_validator(mode="after")
    def _inputs(self) -> "RuleTest":
        if self.log is None and not self.input_samples and not self.dumps:
            raise ValueError("a test needs `log`, `input_samples` or `dumps`")
        from ..readers.parsers import CompositeParser, UnknownFormat  # the parsers' registry
        try:
            CompositeParser(self.parser_format, self.pattern)
        except UnknownFormat as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def parser_format(self) -> str:
        """A pattern alone means the user's own format, as `replay --pattern` does."""
        return "custom" if self.pattern and self.format == "auto" else self.format


class RuleTestFile(Strict):
    rule_files: list[str] | None = None   # relative to the test file, globs allowed; None: shipped
    evaluation_interval: Duration = Field(1.0, gt=0)
    tests: list[RuleTest] = Field(min_length=1)


