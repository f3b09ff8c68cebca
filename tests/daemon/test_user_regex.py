"""The real agent as a subprocess with the user regexes of issue 23 that froze it on Python's
backtracking engine: a rule's ``match`` of ``(a+)+b`` and a log file named with 34 ``a`` (the run
label it is matched against), and a custom ``pattern`` holding ``(\\d+\\s?)+$`` with a line of 40
digits. Each took minutes to hours per match (exponential), holding the worker and the GIL:
``/metrics`` stopped answering and SIGTERM was ignored. On RE2 both are linear: the lines are
read, the endpoints answer, a NaN written afterwards pages and SIGTERM stops the agent."""

from __future__ import annotations

import signal
import subprocess

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
STOP_DEADLINE = 30.0   # interpreter teardown on a loaded CI runner; a frozen worker never gets there


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
    yield proc.start(), logs, custom
    proc.kill()


def _firing(agent: AgentProcess, run: str) -> bool:
    return any(a["alertname"] == "TrainingNonFinite" and a["labels"].get("run") == run
               and a["state"] == "firing" for a in agent.alerts())


def test_hostile_rule_match_and_custom_pattern_never_freeze_the_agent(agent):
    agent, logs, custom = agent
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

    agent.proc.send_signal(signal.SIGTERM)
    try:
        code = agent.proc.wait(STOP_DEADLINE)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"SIGTERM not honoured within {STOP_DEADLINE:.0f} s:\n{agent.stderr()}") from None
    assert code == 0, agent.stderr()
