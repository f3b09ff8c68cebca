"""The real agent as a subprocess on a hostile host: a damaged state database, a watch that must
be polled (as on NFS/Lustre), an inotify watch limit too small for the tree."""

import json
import os
import re
import subprocess

import pytest

from support.agent import AgentProcess, write_megatron
from conftest import wait_for


@pytest.fixture
def dirs(tmp_path):
    logs, state = tmp_path / "logs", tmp_path / "state"
    logs.mkdir()
    state.mkdir()
    return logs, state


def test_garbage_state_db_is_moved_aside_counted_and_logs_read_from_the_start(dirs):
    logs, state = dirs
    (state / "state.sqlite3").write_bytes(os.urandom(4096) + b"\0" * 4096)
    agent = AgentProcess(logs, state).start()
    try:
        assert agent.metric("precision_agent_errors_total", kind="state") == 1  # counted, and still running
        moved = [p for p in state.iterdir() if p.name.startswith("state.sqlite3.corrupt-")]
        assert len(moved) == 1 and moved[0].stat().st_size == 8192
        line = next(ln for ln in agent.stderr().splitlines() if "state error" in ln)
        assert "ERROR" in line and str(moved[0]) in line and "not a usable SQLite database" in line
        write_megatron(logs / "train.log", 1, 30)
        wait_for(lambda: agent.metric("precision_agent_training_step") == 30, what="step 30 on /metrics")
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 30,  # from the first line
                 what="the 30 lines counted")
        assert agent.stop() == 0
    finally:
        agent.kill()
    again = AgentProcess(logs, state).start()  # the fresh store it made is healthy and remembered
    try:
        write_megatron(logs / "train.log", 31, 32)
        wait_for(lambda: again.metric("precision_agent_training_step") == 32, what="step 32 after restart")
        wait_for(lambda: again.metric("precision_agent_log_lines_read_total") == 2, what="the 2 lines counted")
        assert again.metric("precision_agent_errors_total", kind="state") == 0
        assert again.stop() == 0
    finally:
        again.kill()


def test_unusable_state_dir_exits_2_naming_the_field(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    proc = subprocess.run(AgentProcess(logs, blocker / "state").args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"{blocker / 'state'}: state_dir: cannot use it as the state directory" in proc.stderr


def test_poll_true_picks_up_appends_long_before_the_resync(dirs, tmp_path):
    logs, state = dirs
    polled = tmp_path / "polled"
    polled.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text(f"resync_interval: 1h\nwatches:\n  - path: {polled}\n    poll: true\n    poll_interval: 200ms\n")
    agent = AgentProcess(logs, state, "--config", str(cfg)).start()
    try:
        wait_for(lambda: re.search(rf"polling {re.escape(str(polled))} every 0.2s \(poll: true\)", agent.stderr()),
                 what="the polling line in the log")
        log = polled / "train.log"
        write_megatron(log, 1, 5)  # created after the first resync: only the poller can see it
        wait_for(lambda: agent.metric("precision_agent_training_step") == 5, what="new file found by polling")
        write_megatron(log, 6, 9)
        wait_for(lambda: agent.metric("precision_agent_training_step") == 9, what="append found by polling")
        assert agent.metric("precision_agent_resyncs_total") == 1  # only the start-up pass ran
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 9, what="the 9 lines counted")
        modes = {w["path"]: w["mode"] for w in json.loads(agent.get("/api/v1/status"))["data"]["watches"]}
        assert modes[str(polled)] == "poll" and modes[str(logs)] == "inotify"
        assert agent.stop() == 0
    finally:
        agent.kill()
