"""The daemon on a dump watch: another process writes a step's dumps; once the directory is
quiet it is scanned once, the first bad op pages, and a restart rescans nothing."""

import subprocess
import sys
import time

from agentproc import AgentProcess
from conftest import wait_for

WRITER = r"""
import sys, numpy as np, pathlib
d = pathlib.Path(sys.argv[1]) / "step3"
d.mkdir(parents=True)
x = np.ones((4, 4), np.float32)
y = x.copy(); y[0, 1] = np.nan
np.save(d / "000_matmul.npy", x)
np.save(d / "001_softmax.npy", y)    # first non-finite output
np.save(d / "002_add.npy", y)        # propagation
"""


def test_dump_watch_pages_first_bad_op_once(tmp_path):
    dumps, state = tmp_path / "dumps", tmp_path / "state"
    dumps.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text("dump_settle: 0.5s\n")
    args = ("--config", str(cfg), "--watch", f"dump:{dumps}")
    agent = AgentProcess(tmp_path / "nolog", state, *args).start()
    try:
        subprocess.run([sys.executable, "-c", WRITER, str(dumps)], check=True, timeout=60)
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="DumpNonFinite", alertstate="firing",
                                      op="001_softmax.npy"), timeout=30, what="DumpNonFinite firing")
        (alert,) = [a for a in agent.alerts() if a["alertname"] == "DumpNonFinite"]
        assert alert["evidence"]["evidence"]["nonfinite"] == 1 and alert["labels"]["severity"] == "page"
        assert agent.metric("precision_agent_dump_files_scanned_total") == 3
        assert agent.stop() == 0
    finally:
        agent.kill()
    again = AgentProcess(tmp_path / "nolog", state, *args).start()
    try:
        wait_for(lambda: again.metric("precision_agent_resyncs_total") >= 1,
                 what="first resync after restart")
        deadline = time.monotonic() + 2.0  # longer than dump_settle: a rescan would have happened
        while time.monotonic() < deadline:
            assert again.metric("precision_agent_dump_files_scanned_total") == 0
            time.sleep(0.1)
        (alert2,) = [a for a in again.alerts() if a["alertname"] == "DumpNonFinite"]
        assert alert2["firedAt"] == alert["firedAt"]
    finally:
        again.stop()
