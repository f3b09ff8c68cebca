"""A real agent following a kernel-log folder (``format: kernel``) and a training-log folder, and lines
appended by another process, one flush each, as syslog or a trainer writes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.agent import AgentProcess

WRITER = r"""
import sys
path, lines = sys.argv[1], sys.argv[2:]
with open(path, "a") as f:
    for line in lines:
        f.write(line + "\n")
        f.flush()
"""


def append_lines(path: Path, lines: list[str]) -> None:
    subprocess.run([sys.executable, "-c", WRITER, str(path), *lines], check=True, timeout=60)


def kernel_agent(tmp_path: Path, logs_watch: dict[str, Any] | None = None, **config: Any) -> tuple[AgentProcess, Path, Path]:
    """An agent (not started) watching ``tmp_path/kernel`` as a kernel log and ``tmp_path/logs`` (with
    ``logs_watch``'s keys), evaluating every 200 ms; ``config``: more keys of its config file.
    Returns the agent, the kern.log it follows and the logs folder."""
    kernel, logs, state = tmp_path / "kernel", tmp_path / "logs", tmp_path / "state"
    for d in (kernel, logs, state):
        d.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text(json.dumps({
        "watches": [{"path": str(kernel), "format": "kernel"}, {"path": str(logs), **(logs_watch or {})}],
        "evaluation_interval": "200ms", "resync_interval": "300ms", **config}))
    proc = AgentProcess(logs, state, "--config", str(cfg))
    proc.args = [a for a in proc.args if a not in ("--watch", str(logs))]   # the config's two watches
    return proc, kernel / "kern.log", logs
