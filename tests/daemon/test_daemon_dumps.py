"""The daemon on a dump watch: another process writes a step's dumps; once the directory is
quiet it is scanned once, the first bad op pages, and a restart rescans nothing."""

import os
import subprocess
import sys
import time

from support.agent import AgentProcess
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
                                      run="dumps"), timeout=30, what="DumpNonFinite firing")
        (alert,) = [a for a in agent.alerts() if a["alertname"] == "DumpNonFinite"]
        assert alert["evidence"]["evidence"]["nonfinite"] == 1 and alert["labels"]["severity"] == "page"
        assert alert["evidence"]["evidence"]["op"] == "001_softmax.npy" and "op" not in alert["labels"]
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


OPDEBUG_WRITER = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[2])
from support import dumps as W
d = W.ge_step_dir(sys.argv[1], 2, 5)     # {time}/{device 2}/{model}/{model_id}/{step 5}
one, sat = np.ones(4, np.float16), np.array([65504.0, 1.0, 1.0, 1.0], np.float16)
W.write_ops(d, [("MatMul", "mm", 10, [one, one], [one]),
                ("Add", "layer3_add", 11, [one], [sat]),
                ("Cast", "cast", 12, [sat], [one])], 1_709_294_400_000_000)
W.write_opdebug(d + "/" + W.opdebug_name(5, 0, 1_709_294_400_000_050), W.old_record(
    {"DHA Atomic Add": {"stream_id": 0, "task_id": 12, "status": 0x0900}}))
W.write_opdebug(d + "/" + W.opdebug_name(5, 0, 1_709_294_400_000_005), W.old_record(
    {"AI Core": {"stream_id": 0, "task_id": 11, "status": 0x20}}))
"""


def test_opdebug_in_a_dump_watch_fires_overflow_with_the_op(tmp_path):
    dumps, state = tmp_path / "dumps", tmp_path / "state"
    dumps.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text("dump_settle: 0.5s\n")
    agent = AgentProcess(tmp_path / "nolog", state, "--config", str(cfg), "--watch", f"dump:{dumps}").start()
    try:
        subprocess.run([sys.executable, "-c", OPDEBUG_WRITER, str(dumps), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))],
                       check=True, timeout=60)
        wait_for(lambda: any(a["alertname"] == "DumpOverflow" and a["evidence"]["evidence"]["op"] == "layer3_add"
                             for a in agent.alerts()), timeout=30, what="DumpOverflow firing for layer3_add")
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="DumpFp16Saturation",
                                      alertstate="firing", op="layer3_add"), what="DumpFp16Saturation firing")
        (alert,) = [a for a in agent.alerts() if a["alertname"] == "DumpOverflow"]
        ev = alert["evidence"]["evidence"]
        assert (ev["accelerator"], ev["status"], ev["task_id"]) == ("AI Core", "float_overflow", 11)
        assert alert["evidence"]["evidence"]["origin_rank"] == "2" and alert["labels"]["severity"] == "ticket"
        assert "float_overflow" in alert["annotations"]["summary"]
        assert agent.metric("precision_agent_dump_files_scanned_total") == 5
    finally:
        agent.stop()
