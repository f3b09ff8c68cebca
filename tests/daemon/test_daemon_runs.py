"""Run identity and finished runs with the real agent as a subprocess; logs written by other processes.

Two runs whose logs share the watched folder are two series: the second run's lines neither resolve
the first run's page nor show up as its loss scale. A run that printed its end-of-training marker
is not reported stalled, while one that just went quiet is."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from support.agent import AgentProcess, write_megatron
from conftest import wait_for


@pytest.fixture
def dirs(tmp_path):
    logs, state = tmp_path / "logs", tmp_path / "state"
    logs.mkdir()
    return logs, state


def firing(agent: AgentProcess, alertname: str, **labels: str) -> list[dict]:
    return [a for a in agent.alerts() if a["alertname"] == alertname and a["state"] == "firing"
            and all(a["labels"].get(k) == v for k, v in labels.items())]


def test_two_runs_in_one_folder_are_two_series(dirs):
    logs, state = dirs
    agent = AgentProcess(logs, state).start()
    try:
        write_megatron(logs / "gpt-a.log", 1, 20, scale="65536.0")
        write_megatron(logs / "gpt-a.log", 21, 25, scale="1.0")  # run a collapses to the floor
        wait_for(lambda: firing(agent, "LossScaleAtFloor", run="gpt-a"), what="run a pages")
        # run b starts in the same folder, healthy, with its own (lower) step numbers
        write_megatron(logs / "gpt-b.log", 1, 30, scale="65536.0")
        wait_for(lambda: agent.metric("precision_agent_training_step", run="gpt-b") == 30, what="run b read")
        assert agent.metric("precision_agent_training_step", run="gpt-a") == 25
        assert agent.metric("precision_agent_training_loss_scale", run="gpt-a") == 1.0
        assert agent.metric("precision_agent_training_loss_scale", run="gpt-b") == 65536.0
        assert firing(agent, "LossScaleAtFloor", run="gpt-a"), "run b's lines resolved run a's page"
        assert not [a for a in agent.alerts() if a["labels"].get("run") == "gpt-b"]
        assert agent.metric("precision_agent_training_loss_scale_decreases_total", run="gpt-b") == 0
    finally:
        agent.stop()


def test_a_restarted_run_is_a_new_attempt_not_an_increase(dirs):
    logs, state = dirs
    agent = AgentProcess(logs, state).start()
    try:
        write_megatron(logs / "train.log", 1, 30, scale="8.0")
        write_megatron(logs / "train.log", 10, 30, scale="65536.0")  # resumed from the step-10 checkpoint
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 51, what="both attempts read")
        assert agent.metric("precision_agent_training_loss_scale", run="train") == 65536.0
        (series,) = [s for s in json.loads(agent.get("/api/v1/status"))["data"]["series"]
                     if s["labels"].get("run") == "train"]
        assert series["attempt"] == 2 and series["scale_increases"] == 0, series
        assert series["loss_scaling"] == "yes"
    finally:
        agent.stop()


STALLED_RULES = """
groups:
  - name: t
    rules:
      - alert: Stalled
        kind: stalled
        params: {after: 2s}
        labels: {severity: warning}
        annotations: {summary: "stalled"}
"""

FINISH = r"""
import sys
with open(sys.argv[1], "a") as f:
    f.write(" [after training is done] datetime: 2025-01-01 10:00:00 \n")
"""


def test_a_finished_run_is_not_stalled_while_a_quiet_one_is(dirs, tmp_path):
    logs, state = dirs
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "stalled.yml").write_text(textwrap.dedent(STALLED_RULES))
    agent = AgentProcess(logs, state, "--rules", str(rules)).start()
    try:
        write_megatron(logs / "done.log", 1, 5)
        subprocess.run([sys.executable, "-c", FINISH, str(logs / "done.log")], check=True, timeout=30)
        write_megatron(logs / "hung.log", 1, 5)
        wait_for(lambda: firing(agent, "Stalled", run="hung"), 30, what="the quiet run reported stalled")
        wait_for(lambda: agent.metric("precision_agent_training_step", run="done") == 5, what="done read")
        assert not firing(agent, "Stalled", run="done")
    finally:
        agent.stop()


COPY = r"""
import sys
with open(sys.argv[1]) as src, open(sys.argv[2], "a") as dst:
    for line in src:
        dst.write(line)
        dst.flush()
"""


@pytest.mark.corpus
def test_real_logs_of_two_runs_in_one_folder(dirs):
    """The real apex collapse (32768 -> 0.25) and a real healthy apex run (32768 -> 8192) written into
    one watched folder: merged, the healthy run's 32768 would resolve the collapse's page."""
    from conftest import corpus_path
    logs, state = dirs
    collapse, healthy = corpus_path("logs", "apex_1.log"), corpus_path("logs", "healthy", "apex_1.log")
    agent = AgentProcess(logs, state).start()
    try:
        subprocess.run([sys.executable, "-c", COPY, str(collapse), str(logs / "job-a.log")], check=True, timeout=30)
        wait_for(lambda: firing(agent, "LossScaleAtFloor", run="job-a"), what="job a pages")
        subprocess.run([sys.executable, "-c", COPY, str(healthy), str(logs / "job-b.log")], check=True, timeout=30)
        wait_for(lambda: agent.metric("precision_agent_training_loss_scale", run="job-b") == 8192.0,
                 what="job b read")
        assert firing(agent, "LossScaleAtFloor", run="job-a") and firing(agent, "LossScaleCollapse", run="job-a")
        assert agent.metric("precision_agent_training_loss_scale", run="job-a") == 0.25
        assert not [a for a in agent.alerts() if a["labels"].get("run") == "job-b"]
    finally:
        agent.stop()


def test_runs_in_their_own_folders_all_writing_train_log_are_two_series(dirs):
    """The common layout ``out/<job>/train.log``: each folder is its own run (``job-a/train``,
    ``job-b/train``), so one job's healthy lines never resolve or merge into the other's page."""
    logs, state = dirs
    (logs / "job-a").mkdir()
    (logs / "job-b").mkdir()
    agent = AgentProcess(logs, state).start()
    try:
        write_megatron(logs / "job-a" / "train.log", 1, 20, scale="65536.0")
        write_megatron(logs / "job-a" / "train.log", 21, 25, scale="1.0")
        wait_for(lambda: firing(agent, "LossScaleAtFloor", run="job-a/train"), what="job a pages")
        write_megatron(logs / "job-b" / "train.log", 1, 30, scale="65536.0")
        wait_for(lambda: agent.metric("precision_agent_training_step", run="job-b/train") == 30, what="job b read")
        assert agent.metric("precision_agent_training_step", run="job-a/train") == 25
        assert firing(agent, "LossScaleAtFloor", run="job-a/train"), "job b's lines resolved job a's page"
        assert not [a for a in agent.alerts() if a["labels"].get("run") == "job-b/train"]
    finally:
        agent.stop()
