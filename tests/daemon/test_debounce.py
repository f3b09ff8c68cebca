"""The worker's ``debounce`` (agent/daemon/worker.py), the real agent as a subprocess: a line
written after a quiet spell is read at once, not after a batch window; lines that come sooner
after a read are held until the window from that read ends, then read together."""

import time

from support.agent import AgentProcess, write_megatron
from conftest import wait_for

DEBOUNCE_S = 8.0  # far above what a read takes, so that "at once" and "held" cannot be confused


def test_a_lone_line_is_read_at_once_and_a_burst_after_it_waits_for_the_window(tmp_path):
    logs, state = tmp_path / "logs", tmp_path / "state"
    logs.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text(f"debounce: {DEBOUNCE_S}s\n")
    log = logs / "train.log"
    write_megatron(log, 1, 1)
    agent = AgentProcess(logs, state, "--config", str(cfg)).start()
    lines = lambda: agent.metric("precision_agent_log_lines_read_total")  # noqa: E731
    try:
        wait_for(lambda: lines() == 1, what="the first line, read at start")
        write_megatron(log, 2, 2)  # no read for a debounce (the start-up catch-up is no window)
        written = time.monotonic()
        wait_for(lambda: lines() == 2, timeout=DEBOUNCE_S / 2, interval=0.01,
                 what=f"the lone line read at once, not after the {DEBOUNCE_S} s debounce")
        read = time.monotonic()
        write_megatron(log, 3, 4)  # a burst right after that read: held until its window ends
        held_until = time.monotonic() + 1.0
        assert held_until - written < DEBOUNCE_S / 2, "the host is too slow for this test's margins"
        while time.monotonic() < held_until:
            assert lines() == 2, "a line that came within the debounce of the last read was read early"
            time.sleep(0.05)
        wait_for(lambda: lines() == 4, timeout=DEBOUNCE_S + 15, what="the held lines, read after the window")
        assert time.monotonic() - read > DEBOUNCE_S / 2
        assert agent.metric("precision_agent_training_step") == 4
    finally:
        assert agent.stop() == 0
