"""Rule files: the shipped ones load; bad ones name file, rule and field; last good is kept."""

import textwrap
from pathlib import Path

import pytest

from precision_agent.config import ConfigError
from precision_agent.engine.rulefile import default_rules_dir, load_rule_file, load_rules, render

GOOD = """
groups:
  - name: g
    rules:
      - alert: Floor
        kind: loss_scale
        params: {floor: 2}
        for: 30s
        labels: {severity: page, team: ml}
        annotations:
          summary: "scale {{ $value }} below {{ $params.floor }} on {{ $labels.run }} at {{ $step }}"
"""


def write(tmp_path: Path, text: str, name: str = "r.yml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_shipped_rules_load():
    rs = load_rules([default_rules_dir()])
    assert not rs.errors
    names = {r.name for r in rs.rules}
    assert {"TrainingNonFinite", "LossScaleAtFloor"} <= names
    assert all(r.severity for r in rs.rules)


def test_good_rule_file(tmp_path):
    (rule,) = load_rule_file(write(tmp_path, GOOD))
    assert rule.spec.for_ == 30.0 and rule.detector.params.floor == 2.0
    ann = rule.annotate((("run", "r1"),), 1.0, 7, None, {})
    assert ann["summary"] == "scale 1 below 2 on r1 at 7"


@pytest.mark.parametrize("mutation, where, reason", [
    (("kind: loss_scale", "kind: loss_scael"), 'rule "Floor" field kind', "unknown rule kind"),
    (("params: {floor: 2}", "params: {floor: low}"), 'rule "Floor"', "floor"),
    (("params: {floor: 2}", "params: {flor: 2}"), 'rule "Floor"', "flor"),
    (("severity: page, ", ""), 'rule "Floor" field labels', "severity is required"),
    (("for: 30s", "for: soon"), 'rule "Floor" field for', "invalid duration"),
    (("{{ $params.floor }}", "{{ $secret }}"), 'rule "Floor" field annotations', "unknown template variable"),
    (("{{ $value }}", "{{ .Value | printf }}"), 'rule "Floor" field annotations', "unsupported template"),
    (("alert: Floor", "alert: 'no spaces'"), "field alert", "must match"),
    (("params:", "match: {labels: {run: '(gpt)-\\1'}}\n        params:"), 'rule "Floor" field match.labels',
     "backreferences are not supported"),
    (("params:", "match: {labels: {run: '(?!bert).*'}}\n        params:"), 'rule "Floor" field match.labels',
     "lookahead and lookbehind are not supported; RE2 syntax, as Prometheus"),
])
def test_bad_rule_files_name_file_rule_field(tmp_path, mutation, where, reason):
    path = write(tmp_path, GOOD.replace(*mutation))
    with pytest.raises(ConfigError) as err:
        load_rule_file(path)
    msg = str(err.value)
    assert str(path) in msg and where in msg and reason in msg, msg


def test_bad_yaml_and_wrong_shape(tmp_path):
    with pytest.raises(ConfigError, match=r"line \d+.*invalid YAML"):
        load_rule_file(write(tmp_path, "groups: [\n  - name: x\n    rules: {"))
    with pytest.raises(ConfigError, match="groups"):
        load_rule_file(write(tmp_path, "rules: []\n"))
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_rule_file(write(tmp_path, "- 1\n- 2\n"))


def test_yaml_is_loaded_safely(tmp_path):
    path = write(tmp_path, "groups: !!python/object/apply:os.system ['echo pwned > /tmp/x']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_rule_file(path)


def test_reload_keeps_last_good_version_and_detector_state(tmp_path):
    path = write(tmp_path, GOOD)
    first = load_rules([tmp_path])
    det = first.rules[0].detector
    second = load_rules([tmp_path], first)
    assert second.rules[0].detector is det  # unchanged file: state kept
    path.write_text("groups: [oops")
    third = load_rules([tmp_path], second)
    assert str(path) in third.errors and [r.name for r in third.rules] == ["Floor"]
    assert load_rules([tmp_path]).rules == []  # without a previous set there is nothing to keep


def test_label_matchers(tmp_path):
    (rule,) = load_rule_file(write(tmp_path, GOOD.replace("params:", "match: {labels: {run: 'gpt-.*'}}\n        params:")))
    assert rule.matches((("run", "gpt-7"),)) and not rule.matches((("run", "bert"),)) and not rule.matches(())
    assert not rule.matches((("run", "my-gpt-7"),))   # anchored at both ends, as Prometheus


def test_label_matchers_are_linear_on_hostile_label_values(tmp_path):
    """Issue 23: ``(a+)+b`` against a run named with 34 ``a`` took hours on a backtracking engine
    (the worker and the GIL held); RE2 answers at once. The test would hang without it."""
    (rule,) = load_rule_file(write(tmp_path, GOOD.replace("params:", "match: {labels: {run: '(a+)+b'}}\n        params:")))
    assert not rule.matches((("run", "a" * 34),)) and not rule.matches((("run", "a" * 100_000 + "c"),))
    assert rule.matches((("run", "a" * 34 + "b"),))
    assert not rule.matches((("run", "a\udcff" * 10),))   # a file name's undecodable byte: no error
    (missing,) = load_rule_file(write(tmp_path, GOOD.replace("params:", "match: {labels: {rank: '|0'}}\n        params:")))
    assert missing.matches(()) and missing.matches((("rank", "0"),)) and not missing.matches((("rank", "1"),))


def test_render_formats_values_and_missing():
    assert render("{{ $value }} {{ $labels.x }}|", {"value": 0.1 + 0.2, "labels": {}}) == "0.3 |"


def test_fresh_rule_set_has_new_detectors(tmp_path):
    write(tmp_path, GOOD)
    rs = load_rules([tmp_path])
    again = rs.fresh()
    assert [r.spec for r in again.rules] == [r.spec for r in rs.rules]
    assert again.rules[0].detector is not rs.rules[0].detector and again.rules_for("loss_scale")
