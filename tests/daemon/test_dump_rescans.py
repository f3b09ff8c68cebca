"""The daemon's dump scans under load (issue 23 items 4 and 9), through the real daemon: 50,000
junk files are each counted once and logged a bounded number of times, never again on a rescan;
a flat dump root growing step by step has each file read once, and a sub-folder's tensor is
named once; a truncated first tensor makes the page say the origin is uncertain."""

import os
import subprocess
import sys
from pathlib import Path

from support.agent import AgentProcess
from conftest import wait_for

SUPPORT = str(Path(__file__).resolve().parent.parent)
JUNK = 50_000

WRITE_NPY = r"""
import sys, numpy as np
a = np.ones(16, np.float32)
if sys.argv[2] == "nan":
    a[3] = np.nan
np.save(sys.argv[1], a)
"""


def _agent(tmp_path: Path, dumps: Path) -> AgentProcess:
    cfg = tmp_path / "agent.yml"
    cfg.write_text("dump_settle: 0.5s\nresync_interval: 2s\n")
    return AgentProcess(tmp_path / "nolog", tmp_path / "state", "--config", str(cfg), "--watch", f"dump:{dumps}")


def _write(path: Path, kind: str = "ok") -> None:
    subprocess.run([sys.executable, "-c", WRITE_NPY, str(path), kind], check=True, timeout=60)


def _scan_error_lines(agent: AgentProcess) -> list[str]:
    return [line for line in agent.stderr().splitlines() if "scan error:" in line]


def _unreadable(agent: AgentProcess) -> float:
    return sum(agent.metric("precision_agent_dump_unreadable_total", cause=c) or 0.0
               for c in ("io", "truncated", "limit", "invalid"))


def test_junk_files_are_counted_once_and_not_logged_again_on_rescans(tmp_path, many_files_dir):
    dumps = many_files_dir   # on a tmpfs where there is one: 50,000 files made and removed in seconds
    for i in range(JUNK):   # tiny junk named like dumps, there before the agent starts
        fd = os.open(dumps / f"{i:06d}.npy", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
    agent = _agent(tmp_path, dumps).start()
    try:
        # minutes on a loaded 2-core machine (a few seconds alone): a deadline, not a timing
        wait_for(lambda: agent.metric("precision_agent_errors_total", kind="scan") >= JUNK, timeout=900,
                 interval=0.5, what="the junk files counted")
        assert agent.metric("precision_agent_errors_total", kind="scan") == JUNK
        assert _unreadable(agent) == JUNK          # one cause each, counted
        assert agent.metric("precision_agent_dump_files_scanned_total") == JUNK
        lines = _scan_error_lines(agent)
        assert 0 < len(lines) <= 40, len(lines)    # at most 10 lines per cause, the rest summed up
        assert "not logged one by one" in agent.stderr()
        resyncs = agent.metric("precision_agent_resyncs_total")
        wait_for(lambda: agent.metric("precision_agent_resyncs_total") >= resyncs + 2, timeout=300,
                 what="two rescan intervals")
        assert _scan_error_lines(agent) == lines   # nothing repeated
        assert agent.metric("precision_agent_errors_total", kind="scan") == JUNK
        # a change: one new junk file and one good one; only these two are read, one new line
        (dumps / "new_junk.npy").write_bytes(b"yy")
        _write(dumps / "good.npy")
        wait_for(lambda: agent.metric("precision_agent_dump_files_scanned_total") >= JUNK + 2, timeout=600,
                 interval=0.5, what="the two new files scanned")
        resyncs = agent.metric("precision_agent_resyncs_total")
        wait_for(lambda: agent.metric("precision_agent_resyncs_total") >= resyncs + 2, timeout=300,
                 what="two more rescan intervals")
        assert agent.metric("precision_agent_dump_files_scanned_total") == JUNK + 2
        assert agent.metric("precision_agent_errors_total", kind="scan") == JUNK + 1
        new = _scan_error_lines(agent)[len(lines):]
        assert len(new) == 1 and "new_junk.npy" in new[0]
    finally:
        agent.stop()


def _paged_ops(agent) -> list[str]:
    """The origin op of every firing DumpNonFinite (one alert per incident: the op is evidence)."""
    return sorted(a["evidence"]["evidence"]["op"] for a in agent.alerts()
                  if a["alertname"] == "DumpNonFinite" and a["state"] == "firing")


def test_a_flat_dump_root_is_read_once_per_file_and_names_each_tensor_once(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    agent = _agent(tmp_path, dumps).start()
    try:
        for step in range(6):
            _write(dumps / f"step{step:03d}.npy", "nan" if step == 4 else "ok")
            wait_for(lambda: agent.metric("precision_agent_dump_files_scanned_total") >= step + 1, timeout=60,
                     what=f"step {step} scanned")
            assert agent.metric("precision_agent_dump_files_scanned_total") == step + 1   # not the whole root
        wait_for(lambda: "step004.npy" in _paged_ops(agent), timeout=30, what="the NaN step paged")
        # a sub-folder beside the flat files: its own unit, its tensor under one name
        (dumps / "late").mkdir()
        _write(dumps / "late" / "x.npy", "nan")
        _write(dumps / "step006.npy")
        wait_for(lambda: "x.npy" in _paged_ops(agent), timeout=60, what="the sub-folder's NaN paged")
        wait_for(lambda: agent.metric("precision_agent_dump_files_scanned_total") >= 8, timeout=60,
                 what="all files scanned")
        resyncs = agent.metric("precision_agent_resyncs_total")
        wait_for(lambda: agent.metric("precision_agent_resyncs_total") >= resyncs + 2, timeout=60,
                 what="two rescan intervals")
        assert agent.metric("precision_agent_dump_files_scanned_total") == 8
        ops = _paged_ops(agent)
        assert ops == ["step004.npy", "x.npy"], ops
    finally:
        agent.stop()


WRITE_MSPROBE = r"""
import os, sys, numpy as np
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from support.torchpt import write_msprobe_pt
rank = Path(sys.argv[1])
one, bad = np.ones(8, np.float32), np.ones(8, np.float32)
bad[3] = np.nan
write_msprobe_pt(rank, {
    "Functional.matmul.0.forward": {"input_args": [one], "output": [bad]},
    "Functional.softmax.0.forward": {"input_args": [one], "output": [bad]},
})
pt = rank / "dump_tensor_data" / "Functional.matmul.0.forward.output.0.pt"
with open(pt, "r+b") as fh:
    fh.truncate(os.path.getsize(pt) // 2)
"""


def test_a_truncated_first_tensor_makes_the_page_say_the_origin_is_uncertain(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    agent = _agent(tmp_path, dumps).start()
    try:
        subprocess.run([sys.executable, "-c", WRITE_MSPROBE, str(dumps / "step0" / "rank0"), SUPPORT],
                       check=True, timeout=60)
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="DumpNonFinite", alertstate="firing"),
                 timeout=60, what="DumpNonFinite firing")
        (alert,) = [a for a in agent.alerts() if a["alertname"] == "DumpNonFinite"]
        assert alert["evidence"]["evidence"]["op"] == "Functional.softmax.0.forward"
        ev = alert["evidence"]["evidence"]
        assert ev["uncertain"] is True and ev["unreadable_before_count"] == 1
        assert "Functional.matmul.0.forward output[0]" in ev["unreadable_before"][0]
        summary, description = alert["annotations"]["summary"], alert["annotations"]["description"]
        assert "from finite inputs" not in summary and "origin uncertain" in summary
        assert "Functional.matmul.0.forward" in description
        assert os.path.basename("Functional.matmul.0.forward.output.0.pt") in agent.stderr()   # its error logged
    finally:
        agent.stop()
