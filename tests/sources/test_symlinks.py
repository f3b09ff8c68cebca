"""Symlinks in watched trees whose target lies outside the watched roots are not followed (log
files and dump files alike) unless the watch says ``follow_symlinks: true``: the real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from support.agent import AgentProcess, write_megatron
from conftest import wait_for

DUMP_WRITER = r"""
import sys, numpy as np, pathlib
out, dumps = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
x = np.ones((4, 4), np.float32)
y = x.copy(); y[0, 1] = np.nan
np.save(out / "nan.npy", y)                   # outside the roots
d = dumps / "step1"
d.mkdir(parents=True)
np.save(d / "000_matmul.npy", x)
(d / "001_softmax.npy").symlink_to(out / "nan.npy")
"""


def test_links_out_of_the_roots_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    logs, dumps = tmp_path / "logs", tmp_path / "dumps"
    for d in (logs, dumps):
        d.mkdir()
    write_megatron(outside / "secret.log", 1, 3, grad="nan")   # another user's file, say
    write_megatron(logs / "train.log", 1, 5)
    (logs / "evil.log").symlink_to(outside / "secret.log")
    (logs / "passwd.log").symlink_to("/etc/passwd")
    os.symlink("train.log", logs / "alias.log")                 # inside the roots: followed
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump({
        "resync_interval": "300ms", "dump_settle": "300ms",
        "watches": [{"path": str(dumps), "kind": "dump"}]}))
    agent = AgentProcess(logs, tmp_path / "state", "--config", str(cfg)).start()
    try:
        subprocess.run([sys.executable, "-c", DUMP_WRITER, str(outside), str(dumps)], check=True, timeout=60)
        wait_for(lambda: agent.metric("precision_agent_training_step") == 5, 30, what="train.log read")
        wait_for(lambda: agent.metric("precision_agent_dump_files_scanned_total"), 30, what="the dump scanned")
        wait_for(lambda: (agent.metric("precision_agent_resyncs_total") or 0) >= 5, 30, what="a few resyncs")
        # evil.log, passwd.log and the dump's link are skipped, each reported once
        assert agent.metric("precision_agent_symlinks_skipped_total") == 3
        err = agent.stderr()
        assert err.count(f"not following {logs / 'evil.log'}") == 1
        assert err.count(f"not following {logs / 'passwd.log'}") == 1
        assert err.count(f"not following {dumps / 'step1' / '001_softmax.npy'}") == 1
        # nothing read through them: no alert from the secret log in the plain watch, no NaN dump
        assert not agent.alerts()
        assert agent.metric("precision_agent_training_nonfinite_values_total", metric="grad_norm") == 0
        status = json.loads(agent.get("/api/v1/status"))["data"]
        files = sorted(f["path"] for f in status["files"])
        assert files == sorted([str(logs / "alias.log"), str(logs / "train.log")])
        text = json.dumps(status)
        assert "/etc/passwd" not in text and str(outside) not in text
        assert agent.metric("precision_agent_errors_total", kind="read") == 0
    finally:
        agent.stop()


def test_follow_symlinks_allows_links_out_of_the_roots(tmp_path: Path) -> None:
    logs, allowed, outside = tmp_path / "logs", tmp_path / "allowed", tmp_path / "outside"
    for d in (logs, allowed, outside):
        d.mkdir()
    write_megatron(outside / "secret.log", 1, 3, grad="nan")
    (logs / "evil.log").symlink_to(outside / "secret.log")
    (allowed / "shared.log").symlink_to(outside / "secret.log")
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump({"watches": [{"path": str(allowed), "labels": {"run": "b"},
                                                "follow_symlinks": True}]}))
    agent = AgentProcess(logs, tmp_path / "state", "--config", str(cfg)).start()
    try:
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="TrainingNonFinite", run="b",
                                      alertstate="firing"), 30, what="the allowed link to be read")
        assert [a["labels"].get("run") for a in agent.alerts()] == ["b"]  # not through logs/evil.log
        assert agent.metric("precision_agent_symlinks_skipped_total") == 1
    finally:
        agent.stop()


def test_a_followed_log_replaced_by_a_link_out_is_not_reopened(tmp_path: Path) -> None:
    logs, outside = tmp_path / "logs", tmp_path / "outside"
    logs.mkdir()
    outside.mkdir()
    write_megatron(outside / "secret.log", 1, 3, grad="nan")
    log = logs / "train.log"
    write_megatron(log, 1, 5)
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump({"resync_interval": "300ms"}))
    agent = AgentProcess(logs, tmp_path / "state", "--config", str(cfg)).start()
    try:
        wait_for(lambda: agent.metric("precision_agent_training_step") == 5, 30, what="the log read")
        tmp = logs / "train.tmp"
        tmp.symlink_to(outside / "secret.log")
        os.replace(tmp, log)  # the name now is a link out of the roots
        wait_for(lambda: agent.metric("precision_agent_symlinks_skipped_total") == 1, 30,
                 what="the replaced name refused")
        assert agent.metric("precision_agent_training_nonfinite_values_total", metric="grad_norm") == 0
        assert agent.stderr().count(f"not following {log}") == 1
    finally:
        agent.stop()
