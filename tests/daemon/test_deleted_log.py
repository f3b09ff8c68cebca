"""A log deleted while the agent is part-way through it is read to its end through the open
descriptor before the agent forgets it: the real daemon, a writer process, a small read budget."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from support.agent import AgentProcess, write_megatron
from conftest import wait_for


def test_a_log_deleted_mid_read_is_read_to_its_end(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump({"resync_interval": "300ms", "debounce": "20ms",
                                   "limits": {"read_budget_bytes": "16KiB", "read_chunk_bytes": "16KiB"}}))
    agent = AgentProcess(logs, tmp_path / "state", "--config", str(cfg)).start()
    log = logs / "train.log"
    try:
        write_megatron(log, 1, 12000)                 # ~3 MB: ~190 passes of 16 KiB
        write_megatron(log, 12001, 12001, grad="nan")  # near the end
        write_megatron(log, 12002, 12010)
        size = log.stat().st_size
        read = wait_for(lambda: agent.metric("precision_agent_log_bytes_read_total"), 30,
                        what="the agent to start reading")
        assert read < size / 2, "the agent must still be part-way through when the file is deleted"
        log.unlink()
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="TrainingNonFinite",
                                      metric="grad_norm", alertstate="firing"), 60,
                 what="the NaN near the end of the deleted log to fire")
        assert agent.metric("precision_agent_log_bytes_read_total") == size
        assert agent.metric("precision_agent_training_step") == 12010
        # then the file is forgotten: no descriptor kept on the deleted inode
        wait_for(lambda: agent.metric("precision_agent_watched_files", kind="log") == 0, 10,
                 what="the deleted log to be dropped")
        fds = [os.readlink(f"/proc/{agent.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{agent.proc.pid}/fd")]
        assert not [f for f in fds if "train.log" in f]
    finally:
        agent.stop()
