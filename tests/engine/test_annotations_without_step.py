"""A finding without a step (a trainer message, a stalled run before its first step) renders
summaries without a dangling "at step ": the shipped rules' annotations, and the render rule."""

import re

from precision_agent.engine.rulefile import default_rules_dir, load_rules, render
from precision_agent.model import SourcePos

DANGLING = re.compile(r"\b(?:step|iteration) (?=[\s.,;:)]|$)", re.MULTILINE)  # "at step " with nothing after


def test_render_drops_the_words_that_introduce_a_missing_step():
    assert render("NaN/Inf in {{ $evidence.metric }} at step {{ $step }}", {"evidence": {"metric": "loss"}}) == \
        "NaN/Inf in loss"
    assert render("was {{ $value }} at step {{ $step }} ({{ $file }}:{{ $line }}).",
                  {"value": 1.0, "file": "f", "line": 3}) == "was 1 (f:3)."
    assert render("first bad op (step {{ $step }}) is x", {}) == "first bad op is x"
    assert render("at step {{ $step }}", {"step": 7}) == "at step 7"  # a known step is kept


def test_no_shipped_annotation_leaves_a_dangling_step():
    rules = load_rules([default_rules_dir()])
    assert rules.rules
    for rule in rules.rules:
        for key, text in rule.annotate((("run", "r"),), 1.0, None, SourcePos("train.log", 3, 10),
                                       {"metric": "loss"}).items():
            assert not DANGLING.search(text), (rule.name, key, text)
