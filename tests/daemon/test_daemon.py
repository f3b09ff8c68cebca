"""The real agent as a subprocess: another process writes the log; we watch /metrics."""

import os

import pytest

from support.agent import AgentProcess, write_megatron
from conftest import wait_for


@pytest.fixture
def dirs(tmp_path):
    logs, state = tmp_path / "logs", tmp_path / "state"
    logs.mkdir()
    return logs, state


def test_alert_fires_survives_restart_without_refiring_or_losing_lines(dirs):
    logs, state = dirs
    log = logs / "train.log"
    agent = AgentProcess(logs, state).start()
    try:
        write_megatron(log, 1, 50)
        wait_for(lambda: agent.metric("precision_agent_training_step") == 50, what="step 50 on /metrics")
        # the counters move just after the samples of the same read: a scrape may fall between
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 50, what="the 50 lines counted")
        assert agent.metric("precision_agent_alerts") is None
        write_megatron(log, 51, 55, scale="1.0")
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="LossScaleAtFloor",
                                      alertstate="firing", severity="page"), what="LossScaleAtFloor firing")
        (alert,) = [a for a in agent.alerts() if a["alertname"] == "LossScaleAtFloor"]
        assert alert["evidence"]["step"] == 51 and alert["evidence"]["source"]["line"] == 51
        # the page is on the API before the rest of its pass is read (worker.py): stop after line 55
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 55, what="lines 52-55 read")
        assert agent.stop() == 0  # SIGTERM: clean exit, state saved
        assert "stopped; state saved" in agent.stderr()
    finally:
        agent.kill()

    write_megatron(log, 56, 60, scale="1.0")  # appended while the agent is down
    agent2 = AgentProcess(logs, state).start()
    try:
        wait_for(lambda: agent2.metric("precision_agent_training_step") == 60, what="step 60 after restart")
        # exactly the 5 lines written while down were read: nothing lost, nothing read twice
        wait_for(lambda: agent2.metric("precision_agent_log_lines_read_total") == 5, what="the 5 lines counted")
        (again,) = [a for a in agent2.alerts() if a["alertname"] == "LossScaleAtFloor"]
        assert again["firedAt"] == alert["firedAt"] and again["state"] == "firing"
        assert again["count"] == alert["count"] + 5 and again["evidence"]["latest"]["step"] == 60
        assert agent.stderr().count("alert LossScaleAtFloor FIRING") == 1
        assert agent2.stderr().count("alert LossScaleAtFloor FIRING") == 0  # not re-fired after restart
        # the series summary survived too: counters continue rather than restart from zero
        assert agent2.metric("precision_agent_training_samples_total") > 55
        write_megatron(log, 61, 62, scale="2048.0")  # the scale recovers: the state-like alert resolves
        wait_for(lambda: agent2.metric("precision_agent_alerts", alertname="LossScaleAtFloor") is None,
                 what="alert resolved")
        # the counter settles at 5 + 2: a line read twice after the restart would overshoot it
        wait_for(lambda: agent2.metric("precision_agent_log_lines_read_total") == 7, what="lines 61-62 counted")
        assert agent2.stop() == 0
    finally:
        agent2.kill()


def test_nan_grad_norm_and_rotation(dirs):
    logs, state = dirs
    log = logs / "train.log"
    write_megatron(log, 1, 10)  # before the agent starts: read from the beginning
    agent = AgentProcess(logs, state).start()
    try:
        wait_for(lambda: agent.metric("precision_agent_training_step") == 10, what="existing lines read")
        os.rename(log, logs / "train.log.1")  # rename rotation; the trainer reopens train.log
        write_megatron(log, 11, 12, grad="nan")
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="TrainingNonFinite",
                                      metric="grad_norm", alertstate="firing"), what="NaN alert")
        wait_for(lambda: agent.metric("precision_agent_training_nonfinite_values_total", metric="grad_norm") == 2,
                 what="nonfinite counter")
        assert agent.metric("precision_agent_log_rotations_total") == 1
        assert agent.metric("precision_agent_errors_total", kind="read") == 0
    finally:
        agent.stop()


def test_hostile_files_do_not_stop_the_agent(dirs):
    logs, state = dirs
    (logs / "garbage.log").write_bytes(os.urandom(200_000) + b"\x00\xff\xfe" * 1000)
    (logs / "huge.log").write_bytes(b"x" * (3 << 20) + b"\n")
    sub = logs / "locked"
    sub.mkdir()
    (sub / "x.log").write_text("hidden\n")
    sub.chmod(0)
    agent = AgentProcess(logs, state).start()
    try:
        write_megatron(logs / "train.log", 1, 3)
        wait_for(lambda: agent.metric("precision_agent_training_step") == 3, what="valid lines after garbage")
        wait_for(lambda: (agent.metric("precision_agent_log_lines_truncated_total") or 0) >= 1,
                 what="the 3 MiB line counted as truncated")
        assert agent.proc.poll() is None
    finally:
        sub.chmod(0o755)
        agent.stop()


def test_open_descriptors_stay_bounded(dirs):
    logs, state = dirs
    cfg = state.parent / "agent.yml"
    cfg.write_text("limits: {max_open_files: 4}\n")
    agent = AgentProcess(logs, state, "--config", str(cfg)).start()
    try:
        for i in range(12):
            write_megatron(logs / f"rank{i}.log", 1, 2)
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 24, what="all 12 files read")
        fds = [os.readlink(f"/proc/{agent.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{agent.proc.pid}/fd")]
        assert len([f for f in fds if f.endswith(".log")]) <= 4, fds
        write_megatron(logs / "rank0.log", 3, 3)  # a closed file is reopened at its saved position
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 25, what="append after close")
    finally:
        agent.stop()
