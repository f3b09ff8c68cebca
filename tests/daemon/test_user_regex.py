"""The real agent as a subprocess with the user regexes of issue 23 that froze it on Python's
backtracking engine: a rule's ``match`` of ``(a+)+b`` and a log file named with 34 ``a`` (the run
label it is matched against), and a custom ``pattern`` holding ``(\\d+\\s?)+$`` with a line of 40
digits. Each took minutes to hours per match (exponential), holding the worker and the GIL:
``/metrics`` stopped answering and SIGTERM was ignored. On RE2 both are linear: the lines are
read, the endpoints answer, a NaN written afterwards pages and SIGTERM stops the agent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import wait_for
from support.agent import AgentProcess, write_megatron

HOSTILE_RULE = """\
groups:
  - name: hostile
    rules:
      - alert: HostileMatch
        kind: nonfinite
        match: {labels: {run: "(a+)+b"}}
        params: {metrics: [loss]}
        labels: {severity: warning}
        annotations: {summary: "never: no run name ends with b here"}
"""
# the custom format of the issue: values from "loss=..." lines, and the backtracking trap
PATTERN = r"(?:loss=(?P<loss>\S+)|(\d+\s?)+)$"
STOP_DEADLINE = 60.0   # the pass under way, then teardown, on a loaded CI runner; a frozen worker never gets there


@pytest.fixture
def agent(tmp_path):
    logs, custom, rules, state = (tmp_path / n for n in ("logs", "custom", "rules", "state"))
    for d in (logs, custom, rules, state):
        d.mkdir()
    (rules / "hostile.yml").write_text(HOSTILE_RULE)
    cfg = tmp_path / "agent.yml"
    cfg.write_text(f"watches:\n  - {{path: {logs}}}\n"
                   f"  - {{path: {custom}, format: custom, pattern: '{PATTERN}'}}\n"
                   f"rule_dirs: [{rules}]\nevaluation_interval: 200ms\n")
    proc = AgentProcess(logs, state, "--config", str(cfg))
    proc.args = [a for a in proc.args if a not in ("--watch", str(logs))]   # the config's two watches
    yield proc.start(), logs, custom, rules
    proc.kill()


def _firing(agent: AgentProcess, run: str) -> bool:
    return any(a["alertname"] == "TrainingNonFinite" and a["labels"].get("run") == run
               and a["state"] == "firing" for a in agent.alerts())


def test_hostile_rule_match_and_custom_pattern_never_freeze_the_agent(agent):
    agent, logs, custom, rules = agent
    assert "HostileMatch" in agent.get("/api/v1/status")
    long_a = "a" * 34
    write_megatron(logs / f"{long_a}.log", 1, 20)              # run label: 34 "a", matched by (a+)+b
    (custom / "job.log").write_text("loss=2.5\n" + "1" * 40 + "\n" + "1" * 40 + "x\n" + "loss=2.25\n")
    # both files read to the end: the worker got past every hostile match
    wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 24, timeout=30,
             what="the 24 lines of both files read")
    assert agent.metric("precision_agent_training_step", run=long_a) == 20
    assert agent.ready()
    assert "precision_agent_log_lines_read_total" in agent.get("/metrics")

    with open(logs / f"{long_a}.log", "a") as f:                       # a NaN loss: pages
        f.write(" iteration       21/    1000 | lm loss: nan | loss scale: 1.0 | grad norm: 1.5 |"
                " number of skipped iterations:   0 | number of nan iterations:   1 |\n")
    with open(custom / "job.log", "a") as f:
        f.write("1" * 40 + "x\nloss=nan\n")
    wait_for(lambda: _firing(agent, long_a), timeout=30, what="TrainingNonFinite on the run named with 34 a")
    wait_for(lambda: _firing(agent, "job"), timeout=30, what="TrainingNonFinite on the custom-format log")
    assert not any(a["alertname"] == "HostileMatch" for a in agent.alerts())

    # a regex RE2 cannot take, on reload: the last good rules stay, the error is counted and named
    errors = agent.metric("precision_agent_errors_total", kind="rule_file")
    (rules / "hostile.yml").write_text(HOSTILE_RULE.replace("(a+)+b", "(a)\\\\1"))
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: agent.metric("precision_agent_errors_total", kind="rule_file") == errors + 1, timeout=30,
             what="the rule file error counted")
    st = json.loads(agent.get("/api/v1/status"))["data"]
    assert "HostileMatch" in [r["alert"] for r in st["rules"]]
    assert "backreferences are not supported" in st["rule_errors"][str(rules / "hostile.yml")]

    agent.proc.send_signal(signal.SIGTERM)
    try:
        code = agent.proc.wait(STOP_DEADLINE)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"SIGTERM not honoured within {STOP_DEADLINE:.0f} s:\n{agent.stderr()}") from None
    assert code == 0, agent.stderr()


def test_a_pattern_re2_cannot_take_exits_2_naming_file_and_field(tmp_path):
    cfg = tmp_path / "agent.yml"
    cfg.write_text(f"watches: [{{path: {tmp_path}, format: custom, pattern: '(?<=loss=)(?P<loss>\\S+)'}}]\n")
    r = subprocess.run([sys.executable, "-m", "precision_agent", "run", "--config", str(cfg), "--state",
                        str(tmp_path / "state")], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert f"{cfg}: watches.0.pattern: " in r.stderr and "lookahead and lookbehind are not supported" in r.stderr


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_sigterm_is_honoured_while_the_worker_is_busy(tmp_path):
    """A catch-up of a large custom-format log (hostile lines among the records) keeps the worker
    busy; SIGTERM is handled by the main thread at once ("stopping"; RE2 releases the GIL while it
    matches), and the worker stops after the pass it is in (bounded by ``read_budget_bytes``),
    saving its state."""
    logs, state = tmp_path / "logs", tmp_path / "state"
    logs.mkdir()
    state.mkdir()
    with open(logs / "big.log", "w") as f:
        for i in range(300_000):
            f.write(f"step {i} loss={2.5 - i * 1e-6:.6f}\n" if i % 4 else "1" * 40 + "x\n")
    cfg = tmp_path / "agent.yml"
    cfg.write_text(f"watches: [{{path: {logs}, format: custom, pattern: '{PATTERN}'}}]\n")
    agent = AgentProcess(logs, state, "--config", str(cfg))
    agent.args = [a for a in agent.args if a not in ("--watch", str(logs))]
    try:
        agent.start()
        cpu0 = _cpu_seconds(agent.proc.pid)
        wait_for(lambda: _cpu_seconds(agent.proc.pid) > cpu0 + 1.0, timeout=30, what="the catch-up under way")
        agent.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "stopping" in agent.stderr(), timeout=10, what="the main thread's 'stopping' while busy")
        try:
            code = agent.proc.wait(STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"SIGTERM not honoured within {STOP_DEADLINE:.0f} s:\n{agent.stderr()}") from None
        assert code == 0, agent.stderr()
        assert "state saved" in agent.stderr()
    finally:
        agent.kill()
