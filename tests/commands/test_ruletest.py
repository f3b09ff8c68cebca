"""``rules test``: unit tests for rule files, run through the real readers, pipeline and AlertBook."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from precision_agent.commands.ruletest import EXIT_BAD_FILE, EXIT_FAILED, EXIT_OK, main, run_file
from precision_agent.config.regex import UserRegex

REPO = Path(__file__).resolve().parents[2]
SHIPPED_TESTS = sorted((REPO / "rules" / "tests").glob("*.yml"))


def megatron(it: int, scale: float, loss: float | None = None, grad_norm: str | None = None, skipped: int = 0) -> str:
    line = f" iteration {it:>4}/ 1000 | consumed samples: {it * 256:>7} | learning rate: 3.0E-05 | global batch size: 256 |"
    if loss is not None:
        line += f" lm loss: {loss:.6E} |"
    line += f" loss scale: {scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm} |"
    return line + f" number of skipped iterations: {skipped:>3} | number of nan iterations:   0 |"


COLLAPSE = "\n".join([megatron(1, 4.0, 3.2, "1.1"), megatron(2, 2.0, skipped=1), megatron(3, 1.0, skipped=1),
                      megatron(4, 1.0, 3.1, "nan")])

RULES = """\
groups:
  - name: g
    rules:
      - alert: ScaleFloor
        kind: loss_scale
        params: {condition: floor, floor: 1}
        for: 30s
        labels: {severity: page, team: ml}
        annotations:
          summary: "scale {{ $value }} at step {{ $step }} ({{ $file }}:{{ $line }})"
      - alert: NaNSeen
        kind: nonfinite
        match: {labels: {run: "gpt-.*"}}
        params: {grad_norm_persist: 1, grad_norm_warmup: 0}
        resolve_after: 2m
        labels: {severity: ticket}
"""


def write(tmp: Path, text: str, name: str = "t.yml", rules: str | None = RULES) -> Path:
    if rules is not None:
        (tmp / "rules.yml").write_text(rules)
    p = tmp / name
    p.write_text(textwrap.dedent(text))
    return p


def check(path: Path, *filters: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = run_file(path, UserRegex(filters[0], "--run") if filters else None, out=out)
    return rc, out.getvalue()


def test_module(tests: str, log: str = COLLAPSE, head: str = "rule_files: [rules.yml]\nevaluation_interval: 10s\n") -> str:
    """One test named "collapse" over ``log`` (10 s apart) with the given alert_rule_test block."""
    return (head + "tests:\n  - name: collapse\n    labels: {run: gpt-1}\n    interval: 10s\n    log: |\n"
            + textwrap.indent(log, " " * 6) + "\n" + textwrap.indent(textwrap.dedent(tests), "    "))


test_module.__test__ = False  # a helper, not a test


# -- the shipped rule tests, through the command line ----------------------------------------------
def test_shipped_rule_tests_exist_and_cover_the_key_rules():
    assert {p.name for p in SHIPPED_TESTS} >= {"training_test.yml", "dumps_test.yml", "fusion_test.yml"}
    text = "\n".join(p.read_text() for p in SHIPPED_TESTS)
    for name in ("TrainingNonFinite", "LossScaleAtFloor", "LossScaleCollapse", "TrainingLossSpike", "TrainingStalled",
                 "DumpNonFinite", "FusionSuspected"):
        assert f"alertname: {name}" in text


def test_shipped_rule_tests_pass_via_the_cli():
    r = subprocess.run([sys.executable, "-m", "precision_agent.commands.ruletest", "test", *map(str, SHIPPED_TESTS)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(SHIPPED_TESTS)


def test_shipped_tests_are_not_loaded_as_rules():
    from precision_agent.engine.rulefile import default_rules_dir, load_rules
    rs = load_rules([default_rules_dir()])
    assert not rs.errors and not any("/tests/" in f for f in rs.by_file)


def test_cli_exit_codes_are_the_worst_of_all_files(tmp_path):
    good = write(tmp_path, test_module("""\
        alert_rule_test:
          - eval_time: 1m
            alertname: NaNSeen
            exp_alerts: [{exp_labels: {run: gpt-1, metric: grad_norm, severity: ticket}}]
        """), "good.yml")
    wrong = write(tmp_path, good.read_text().replace("metric: grad_norm", "metric: loss"), "wrong.yml")
    bad = write(tmp_path, good.read_text().replace("eval_time: 1m", "eval_time: soon"), "bad.yml")
    assert main(["test", str(good)]) == EXIT_OK
    assert main(["test", str(good), str(wrong)]) == EXIT_FAILED
    assert main(["test", str(wrong), str(bad), str(good)]) == EXIT_BAD_FILE
    assert main(["test", "--run", "^nothing$", str(wrong)]) == EXIT_OK  # no test selected
    assert main(["test", "--run", "(?!x)", str(good)]) == EXIT_BAD_FILE  # RE2 syntax, as promtool's Go regexp


def test_rules_check_refuses_a_regex_re2_cannot_take(tmp_path):
    """A label matcher with a backreference loaded by Python's re before; RE2 (as Prometheus) cannot
    take it: ``rules check`` names file, rule and field, and fails."""
    rules = write(tmp_path, RULES.replace("kind: loss_scale", "kind: loss_scale\n        match: {labels: {run: '(a)\\1'}}"),
                  "bad_rules.yml")
    r = subprocess.run([sys.executable, "-m", "precision_agent", "rules", "check", str(rules)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f'{rules}: group "g" rule "ScaleFloor" field match.labels' in r.stdout
    assert "backreferences are not supported" in r.stdout, r.stdout


# -- failures are reported as a diff naming the test ------------------------------------------------
def test_wrong_expected_label_fails_with_a_diff(tmp_path):
    p = write(tmp_path, test_module("""\
        alert_rule_test:
          - eval_time: 1m
            alertname: NaNSeen
            exp_alerts: [{exp_labels: {run: gpt-2, metric: grad_norm, severity: ticket}}]
        """))
    rc, out = check(p)
    assert rc == EXIT_FAILED
    assert 'test "collapse"' in out and "alertname: NaNSeen, time: 60s" in out
    assert '- missing:    {metric="grad_norm", run="gpt-2", severity="ticket"}' in out
    assert '+ unexpected: {metric="grad_norm", run="gpt-1", severity="ticket"}' in out


def test_expected_alert_that_never_fires_and_unexpected_alert_both_fail(tmp_path):
    p = write(tmp_path, test_module("""\
        alert_rule_test:
          - eval_time: 25s
            alertname: NaNSeen
            exp_alerts: [{exp_labels: {run: gpt-1, metric: grad_norm, severity: ticket}}]
          - eval_time: 35s
            alertname: NaNSeen
            exp_alerts: []
        """))
    rc, out = check(p)
    assert rc == EXIT_FAILED
    assert "time: 25s" in out and "got: []" in out  # the NaN is read at 30 s
    assert "time: 35s" in out and "+ unexpected" in out


def test_annotations_are_compared_exactly_when_given(tmp_path):
    tests = """\
        alert_rule_test:
          - eval_time: 1m
            alertname: ScaleFloor
            exp_alerts:
              - exp_labels: {run: gpt-1, severity: page, team: ml}
                exp_annotations: {summary: "%s"}
        """
    ok = write(tmp_path, test_module(tests % "scale 1 at step 3 (train.log:3)"), "ok.yml")
    assert check(ok) == (EXIT_OK, f"Unit Testing: {ok}\n  SUCCESS (1 test(s))\n")
    rc, out = check(write(tmp_path, test_module(tests % "scale 1 at step 3"), "bad.yml"))
    assert rc == EXIT_FAILED and 'summary="scale 1 at step 3 (train.log:3)"' in out


# -- timing: pending does not count, evaluations happen on the evaluation_interval grid --------------
def test_pending_alerts_do_not_count_and_for_is_judged_at_evaluations(tmp_path):
    # scale 1 is read at 20 s (line 3); for: 30s; evaluations every 10 s -> firing at the 50 s one
    p = write(tmp_path, test_module("""\
        alert_rule_test:
          - eval_time: 20s
            alertname: ScaleFloor
            exp_alerts: []
          - eval_time: 49s
            alertname: ScaleFloor
            exp_alerts: []
          - eval_time: 50s
            alertname: ScaleFloor
            exp_alerts: [{exp_labels: {run: gpt-1, severity: page, team: ml}}]
        """))
    assert check(p)[0] == EXIT_OK
    coarse = write(tmp_path, p.read_text().replace("evaluation_interval: 10s", "evaluation_interval: 1m"), "c.yml")
    rc, out = check(coarse)  # the next evaluation after 50 s is at 60 s: still pending at 50 s
    assert rc == EXIT_FAILED and "time: 50s" in out and 'pending, not compared: {run="gpt-1"' in out


def test_event_alert_resolves_after_resolve_after(tmp_path):
    p = write(tmp_path, test_module("""\
        alert_rule_test:
          - eval_time: 2m29s
            alertname: NaNSeen
            exp_alerts: [{exp_labels: {run: gpt-1, metric: grad_norm, severity: ticket}}]
          - eval_time: 2m30s
            alertname: NaNSeen
            exp_alerts: []
        """, head="rule_files: [rules.yml]\nevaluation_interval: 1s\n"))
    assert check(p) == (EXIT_OK, f"Unit Testing: {p}\n  SUCCESS (1 test(s))\n")


def test_match_labels_of_a_rule_apply_to_the_test_labels(tmp_path):
    text = test_module("""\
        alert_rule_test:
          - eval_time: 1m
            alertname: NaNSeen
            exp_alerts: []
        """).replace("{run: gpt-1}", "{run: bert-1}")
    assert check(write(tmp_path, text))[0] == EXIT_OK


def test_input_samples_and_yaml_numbers_as_labels(tmp_path):
    p = write(tmp_path, """\
        rule_files: [rules.yml]
        tests:
          - name: typed
            labels: {run: gpt-x}
            input_samples:
              - {metric: loss, value: 2.0, step: 1, labels: {rank: 0}}
              - {metric: loss, value: nan, step: 2, at: 3s, labels: {rank: 0}}
              - {metric: grad_norm, value: -inf, step: 2, at: 3s, labels: {rank: 1}}
            alert_rule_test:
              - eval_time: 2s
                alertname: NaNSeen
                exp_alerts: []
              - eval_time: 3s
                alertname: NaNSeen
                exp_alerts:
                  - exp_labels: {run: gpt-x, rank: 1, metric: grad_norm, severity: ticket, alertname: NaNSeen}
                  - exp_labels: {run: gpt-x, rank: 0, metric: loss, severity: ticket}
        """)
    assert check(p)[0] == EXIT_OK


def test_dump_directories_go_through_the_real_scanner(tmp_path):
    dump = tmp_path / "dump" / "step7"
    dump.mkdir(parents=True)
    np.save(dump / "a.npy", np.ones(8, np.float32))
    bad = np.ones(8, np.float32)
    bad[3] = np.nan
    np.save(dump / "b.npy", bad)
    p = write(tmp_path, """\
        rule_files: [%s]
        evaluation_interval: 1m
        tests:
          - name: scanned
            labels: {job: j}
            dumps: [{path: dump, at: 2m}]
            alert_rule_test:
              - eval_time: 1m
                alertname: DumpNonFinite
                exp_alerts: []
              - eval_time: 2m
                alertname: DumpNonFinite
                exp_alerts: [{exp_labels: {job: j, incident: 1, severity: page},
                              exp_annotations: {summary: "step7/b.npy produced NaN/Inf from finite inputs (no step or rank number)"}}]
        """ % (REPO / "rules" / "dumps.yml"), rules=None)
    rc, out = check(p)
    assert rc == EXIT_OK, out


# -- bad test files and bad rule files: exit 2 naming the file and the field -------------------------
@pytest.mark.parametrize("change, field", [
    (("eval_time: 1m", "eval_time: soon"), 'test "collapse" (tests.0) field alert_rule_test.0.eval_time'),
    (("exp_alerts:", "exp_alert:"), "field alert_rule_test.0.exp_alert"),
    (("alertname: NaNSeen", "alertname: NaNSeem"), "field alert_rule_test.0.alertname: no rule named 'NaNSeem'"),
    (("interval: 10s", "format: nosuch"), "unknown log format 'nosuch'"),
    (("labels: {run: gpt-1}", "labels: {severity: x}"), "field labels"),
    (("evaluation_interval: 10s", "evaluation_interval: 0s"), "field evaluation_interval"),
    (("eval_time: 1m", "eval_time: 1000d"), "raise evaluation_interval"),
    (("rule_files: [rules.yml]", "rule_files: [nope/*.yml]"), "field rule_files.0: 'nope/*.yml' matches no file"),
])
def test_malformed_test_file_exits_2_naming_the_field(tmp_path, change, field):
    good = test_module("""\
        alert_rule_test:
          - eval_time: 1m
            alertname: NaNSeen
            exp_alerts: []
        """)
    assert change[0] in good
    rc, out = check(write(tmp_path, good.replace(*change)))
    assert rc == EXIT_BAD_FILE, out
    assert f"FAILED: {tmp_path / 't.yml'}: " in out and field in out


def test_unknown_metric_and_missing_inputs_are_bad_files(tmp_path):
    p = write(tmp_path, """\
        rule_files: [rules.yml]
        tests:
          - name: x
            input_samples: [{metric: los, value: 1}]
            alert_rule_test: [{eval_time: 1s, alertname: NaNSeen}]
          - name: y
            alert_rule_test: [{eval_time: 1s, alertname: NaNSeen}]
        """)
    rc, out = check(p)
    assert rc == EXIT_BAD_FILE and 'test "x" (tests.0) field input_samples.0.metric: unknown metric \'los\'' in out
    p.write_text(p.read_text().replace("metric: los", "metric: loss"))
    rc, out = check(p)
    assert rc == EXIT_BAD_FILE and 'test "y" (tests.1)' in out and "needs `log`, `input_samples` or `dumps`" in out


def test_a_bad_rule_file_is_an_error_not_skipped(tmp_path):
    broken = RULES.replace("severity: ticket", "severity: sometimes")
    p = write(tmp_path, test_module("""\
        alert_rule_test:
          - eval_time: 1m
            alertname: ScaleFloor
            exp_alerts: []
        """), rules=broken)
    rc, out = check(p)
    assert rc == EXIT_BAD_FILE
    assert "rule file" in out and "rules.yml" in out and 'rule "NaNSeen" field labels' in out


def test_yaml_syntax_error_and_missing_file_exit_2(tmp_path):
    p = write(tmp_path, "tests: [\n")
    rc, out = check(p)
    assert rc == EXIT_BAD_FILE and str(p) in out
    rc, out = check(tmp_path / "absent.yml")
    assert rc == EXIT_BAD_FILE and "absent.yml" in out


def test_custom_pattern_format_and_run_filter(tmp_path):
    p = write(tmp_path, """\
        rule_files: [rules.yml]
        tests:
          - name: own format
            labels: {run: gpt-p}
            pattern: 'step=(?P<step>\\d+) loss=(?P<loss>\\S+)'
            interval: 0s               # a backlog: every line at once
            log: |
              step=1 loss=2.5
              unrelated chatter
              step=2 loss=nan
            alert_rule_test:
              - eval_time: 0s
                alertname: NaNSeen
                exp_alerts:
                  - exp_labels: {run: gpt-p, metric: loss, severity: ticket}
          - name: other
            labels: {run: gpt-q}
            input_samples: [{metric: loss, value: nan}]
            alert_rule_test:
              - eval_time: 0s
                alertname: NaNSeen
                exp_alerts: []
        """)
    rc, out = check(p)
    assert rc == EXIT_FAILED and 'test "other"' in out and 'test "own format"' not in out
    assert check(p, "^own") == (EXIT_OK, f"Unit Testing: {p}\n  SUCCESS (1 test(s))\n")
