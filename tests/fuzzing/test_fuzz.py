"""The fuzz suite: generated hostile inputs for every reader, the rule/config/rule-test files and
the HTTP listener (tests/fuzzing/). Over ten thousand cases per run, deterministic: the seed is
$PRECISION_AGENT_FUZZ_SEED (default 14) and every failure names its target, seed and case,
replayable alone with ``python tests/fuzzing/replay.py TARGET CASE --seed SEED --show``.

A case fails when the code raises anything but its documented error type, takes over 2 s (or
hangs: killed after 10 s), dies (a signal), or allocates past its child's 1 GiB address-space
cap; each target's peak RSS growth is bounded too. The longer run is ``python -m bench.fuzz``.

Also here: the inputs the fuzzer found, minimized, as plain regression tests.
"""

from __future__ import annotations

import signal
import socket


import pytest

from support.agent import AgentProcess
from fuzzing.core import CaseTimeout, seed_from_env, run_target
from fuzzing.web import run_http
from fuzzing.targets import MIN_CASES, RSS_BOUND_MB, TARGETS, TEST_PLAN, known_issue
from precision_agent.config import ConfigError, load_config
from precision_agent.readers.parsers import Block, CompositeParser
from precision_agent.engine.rulefile import load_rule_file

SEED = seed_from_env()
RSS_GROWTH_MB = 400          # per target, over the child's start
_counted: dict[str, int] = {}


def _report(capsys: pytest.CaptureFixture, rep) -> None:
    """One line per target on the terminal, whatever the capture mode: the count is the point."""
    _counted[rep.target] = rep.cases
    line = (f"fuzz {rep.target}: {rep.cases} cases, seed {rep.seed}, {rep.seconds:.1f} s, slowest "
            f"{rep.slowest_s * 1000:.0f} ms (case {rep.slowest_index}), peak RSS +{rep.rss_growth_mb:.0f} MB; "
            f"{sum(_counted.values())} cases so far")
    with capsys.disabled():
        print(f"\n{line}", flush=True)


def test_plan_is_at_least_ten_thousand_cases():
    assert sum(TEST_PLAN.values()) >= MIN_CASES
    assert set(TEST_PLAN) == set(TARGETS) | {"http"}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_target(name, capsys):
    rep = run_target(TARGETS[name], SEED, TEST_PLAN[name])
    _report(capsys, rep)
    assert rep.cases == TEST_PLAN[name]
    known = [(f, r) for f in rep.failures if (r := known_issue(name, f.detail)) is not None]
    other = [f for f in rep.failures if known_issue(name, f.detail) is None]
    assert not other, (f"{len(other)} failing case(s) of {name} (seed {SEED}); replay one with "
                       f"python tests/fuzzing/replay.py {name} CASE --seed {SEED} --show\n"
                       + "\n".join(str(f) for f in other[:10]))
    assert rep.rss_growth_mb < RSS_BOUND_MB.get(name, RSS_GROWTH_MB)
    if known:
        pytest.xfail(f"known issue outside this suite's code: {known[0][1]}; cases: "
                     + "; ".join(str(f) for f, _ in known[:5]))


def test_fuzz_http(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    agent = AgentProcess(tmp_path / "logs", tmp_path / "state").start()
    try:
        rep = run_http(agent.port, agent.proc.pid, SEED, TEST_PLAN["http"])
        _report(capsys, rep)
        assert rep.cases == TEST_PLAN["http"]
        assert not rep.failures, "\n".join(str(f) for f in rep.failures[:10]) + "\n" + agent.stderr()[-3000:]
        assert rep.rss_growth_mb < 100
    finally:
        agent.stop()


# -- what the fuzzer found, minimized ---------------------------------------------------------------
def _within(seconds: float, fn, *args):
    """Run ``fn``; a hang (not slowness) fails the test: SIGALRM after ``seconds``."""
    def alarm(signum, frame):
        raise CaseTimeout()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    except CaseTimeout:
        pytest.fail(f"still running after {seconds:.0f} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


FOUND_LINES = {
    # int() of 4300+ digits raised inside the parser: the block lost its records
    "huge_step": "iter " + "9" * 5000 + ": loss 3.9172, time 28841.06ms, mfu 11.62%\n"
                 "INFO:tensorflow:Saving dict for global step " + "9" * 5000 + ": loss = 0.25\n",
    # quadratic: FLOAT's \d+\.?\d* split a digit run every way before failing
    "digit_run": "{'loss': 1.5, 'epoch': " + "9" * 60_000 + "x}\n",
    # quadratic: hints' launcher alternative scanned to the line's end from every ".py"
    "launcher_words": "fp16 " + ".py " * 100_000 + "\n",
    "run_stop_keys": '"key": "run_stop" ' * 40_000 + "\n",
    # quadratic: torchtitan's optional lr scan ran to the line's end from every record
    "glued_records": "step: 1  loss: 2.5 " * 30_000 + "\n",
    # quadratic: user_print's separator alternatives ([ \t]+ then [ \t]*) on a run of tabs
    "tab_run": "loss" + "\t" * 60_000 + "x\n",
    "fairseq_open_brace": "| train_inner | {" * 40_000 + "\n",
    # quadratic: user_print's step pattern \s*[:=#]?\s* on a run of spaces
    "step_spaces": "loss = 2.25, step" + " " * 60_000 + "x\n",
    # float() of a JSON integer beyond float's range raised OverflowError in the jsonl parser
    "json_huge_int": '{"step": 3, "loss": ' + "9" * 400 + "}\n",
    # json.loads raised RecursionError (not a ValueError) on arrays nested thousands deep
    "json_deep": '{"step": 3, "loss": 1.5, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
}


@pytest.mark.parametrize("name", sorted(FOUND_LINES))
def test_found_hostile_lines_parse_in_bounded_time(name):
    parser = CompositeParser()
    _within(10, parser.parse, Block(FOUND_LINES[name], 1))
    assert parser.errors == []


def test_found_huge_step_is_no_step():
    recs = CompositeParser().parse(Block("iter " + "9" * 5000 + ": loss 3.9172, time 1.0ms, mfu 1%\n"
                                         "iter 12: loss 2.5, time 1.0ms, mfu 1%\n", 1))
    assert [(r.step, r.values[0][1]) for r in recs if r.producer == "nanogpt"] == [(None, 3.9172), (12, 2.5)]


@pytest.mark.parametrize("text,reason", [
    ("groups: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than 32"),
    ("groups:\n" + "".join(" " * i + "- \n" for i in range(0, 2000, 2)), "nested"),
    ("groups: " + "{a: " * 100 + "x" + "}" * 100 + "\n", "nested deeper than 32"),
    ("a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 9)}]\n" for i in range(1, 10)) + "groups: *a9\n",
     "more than 1000000 values"),
    ("groups: " + "1" * 5000 + "\n", "invalid YAML value"),
    ("groups: []\n# " + "x" * (1 << 20) + "\n", "larger than 1 MiB"),
])
def test_found_hostile_yaml_is_a_config_error(tmp_path, text, reason):
    path = tmp_path / "r.yml"
    path.write_text(text)
    for load in (load_rule_file, load_config):
        with pytest.raises(ConfigError) as exc:
            _within(10, load, path)
        assert reason in str(exc.value)


def test_found_flow_nesting_is_refused_before_pyyaml_spends_seconds(tmp_path):
    path = tmp_path / "r.yml"
    path.write_text("groups: " + "[" * 450 + "]" * 450 + "\n")   # PyYAML alone: ~5 s, then RecursionError
    with pytest.raises(ConfigError, match="nested deeper than 32"):
        _within(10, load_rule_file, path)
    path.write_text('groups: []\n# [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\nx: "{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{"\n')
    with pytest.raises(ConfigError, match="field x"):   # brackets in comments and strings do not count
        load_rule_file(path)


@pytest.mark.parametrize("value", ["9" * 400, ".inf", "9" * 400 + "h"])
def test_found_durations_beyond_float_are_config_errors(tmp_path, value):
    path = tmp_path / "c.yml"
    path.write_text(f"resync_interval: {value}\n")
    with pytest.raises(ConfigError, match="finite"):
        load_config(path)


def test_found_rule_test_naming_a_too_long_file_is_a_bad_file(tmp_path):
    from precision_agent.commands.ruletest import run_file
    import io
    path = tmp_path / "t_test.yml"
    path.write_text("rule_files: [" + "x" * 5000 + ".yml]\ntests: [{name: a, input_samples: [{metric: loss, value: 1}], alert_rule_test: [{eval_time: 0s, alertname: X, exp_alerts: []}]}]\n")
    out = io.StringIO()
    assert run_file(path, out=out) == 2 and "File name too long" in out.getvalue()


def test_found_http09_is_answered_with_a_status_line(tmp_path):
    (tmp_path / "logs").mkdir()
    agent = AgentProcess(tmp_path / "logs", tmp_path / "state").start()
    try:
        for raw, status in ((b"OPTIONS /metrics HTTP/0.9\r\n\r\n", b"505"), (b"PATCH /x\r\n\r\n", b"400"),
                            (b"GET / / HTTP/0.9\r\n\r\n", b"400"),
                            (b"GET /-/healthy\r\n\r\n", b"200")):
            with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as s:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
                got = s.recv(64)
            assert got.startswith(b"HTTP/1.0 " + status), (raw, got)
    finally:
        agent.stop()



