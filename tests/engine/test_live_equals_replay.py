"""The daemon, fed line by line at random chunk boundaries with a rotation in between, reaches
the same conclusions as `replay` on the finished file: same scale trajectory, same overflow
steps, same findings per rule."""

import json
import random
import subprocess
import sys

import pytest

from support.agent import AgentProcess
from conftest import CORPUS, wait_for

WRITER = r"""
import os, random, sys, time
src, dst, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rnd = random.Random(seed)
data = open(src, "rb").read()
if not data.endswith(b"\n"):
    data += b"\n"
rotate_at = data.find(b"\n", len(data) // 2) + 1   # rotate on a line boundary, mid-file
pos, f = 0, open(dst, "ab")
while pos < len(data):
    end = min(len(data), pos + rnd.randint(1, 700))
    if pos < rotate_at <= end:
        end = rotate_at
    f.write(data[pos:end]); f.flush()
    pos = end
    if pos == rotate_at:
        # an agent cannot follow a file it never opened: give it a moment before rotating
        time.sleep(1.0)
        f.close(); os.rename(dst, dst + ".1"); f = open(dst, "ab")   # rename rotation
    if rnd.random() < 0.3:
        time.sleep(rnd.random() * 0.02)
f.close()
"""


def corpus_logs():
    logs = CORPUS / "logs"
    if not logs.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason="shared corpus absent"))]
    return sorted(p.name for p in logs.glob("*.log"))


def replay(path):
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "replay", "--json", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr     # 1: a page/critical finding (README's exit codes)
    return json.loads(proc.stdout)


@pytest.mark.corpus
@pytest.mark.parametrize("name", corpus_logs())
def test_live_matches_replay(tmp_path, name):
    src = CORPUS / "logs" / name
    expected = replay(src)
    logs, state = tmp_path / "logs", tmp_path / "state"
    logs.mkdir()
    agent = AgentProcess(logs, state).start()
    try:
        dst = logs / "train.log"
        seed = random.Random(name).randint(0, 1 << 30)
        subprocess.run([sys.executable, "-c", WRITER, str(src), str(dst), str(seed)], check=True, timeout=120)
        total = src.read_bytes().count(b"\n") + (0 if src.read_bytes().endswith(b"\n") else 1)
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == total, timeout=30,
                 what=f"all {total} lines read live")
        status = json.loads(agent.get("/api/v1/status"))["data"]
        series = status["series"]
        overflow = sum(s["overflow_steps"] for s in series)
        assert overflow == expected["overflow_steps"]
        scaled = [s for s in series if s["scale_first"] is not None]
        if expected["loss_scale"] is None:
            assert scaled == []
        else:
            ls = expected["loss_scale"]
            assert scaled[0]["scale_first"] == ls["first"] and scaled[-1]["scale_last"] == ls["last"]
            assert min(s["scale_min"] for s in scaled) == ls["min"]
            assert sum(s["scale_decreases"] for s in scaled) == ls["decreases"]
            assert sum(s["scale_increases"] for s in scaled) == ls["increases"]
        by_rule: dict[str, int] = {}
        for f in expected["findings"]:
            by_rule[f["rule"]] = by_rule.get(f["rule"], 0) + 1
        for rule, n in by_rule.items():
            assert agent.metric("precision_agent_findings_total", alertname=rule) == n, rule
        assert agent.metric("precision_agent_log_rotations_total") == 1
    finally:
        agent.stop()
