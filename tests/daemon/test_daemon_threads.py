"""The real daemon's thread count is fixed by its configuration, never by the host's CPU count:
after following many files and scanning a dump, /proc/PID/status says no more threads than
daemon/threads.py documents (native BLAS/OpenMP pools would add one per core of the host)."""

import os
import subprocess
import sys
from pathlib import Path

from support.agent import AgentProcess
from conftest import wait_for

from precision_agent.config import load_config
from precision_agent.daemon.threads import POOL_VARIABLES, expected_threads

FILES = 300

WRITER = r"""
import sys, numpy as np, pathlib
d = pathlib.Path(sys.argv[1]) / "step1"
d.mkdir(parents=True)
for i in range(4):
    np.save(d / f"{i:03d}_matmul.npy", np.full((64, 64), i, np.float32))
"""


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line in /proc/PID/status")


def test_thread_count_bounded_by_config_not_cpus(tmp_path: Path) -> None:
    logs, dumps, state = tmp_path / "logs", tmp_path / "dumps", tmp_path / "state"
    logs.mkdir()
    dumps.mkdir()
    line = (" iteration        1/    1000 | consumed samples:            8 | learning rate: 1.000000E-04 |"
            " global batch size:     8 | lm loss: 5.000000E+00 | loss scale: 65536.0 | grad norm: 1.5 |\n")
    for i in range(FILES):
        (logs / f"job{i:04d}.log").write_text(line * 3)
    cfg = tmp_path / "agent.yml"
    # poll: false: the bound is then exact (a watch that may poll may add a polling observer)
    cfg.write_text(f"dump_settle: 0.3s\nwatches:\n  - {{path: '{logs}', poll: false}}\n"
                   f"  - {{path: '{dumps}', kind: dump, poll: false}}\n")
    agent = AgentProcess(logs, state, "--config", str(cfg))
    agent.args = [a for a in agent.args if a not in ("--watch", str(logs))]  # the config's watches only
    # the test's own environment must not do the daemon's work: no pool variable is passed on
    env = {k: v for k, v in os.environ.items() if k not in POOL_VARIABLES}
    agent._err = open(agent.stderr_path, "ab")
    agent.proc = subprocess.Popen(agent.args, stdout=subprocess.DEVNULL, stderr=agent._err, env=env)
    try:
        wait_for(agent.ready, 30, what="agent ready")
        bound = expected_threads(load_config(cfg))
        seen = [_threads(agent.proc.pid)]

        def read_all() -> bool:
            seen.append(_threads(agent.proc.pid))
            return agent.metric("precision_agent_log_lines_read_total") == FILES * 3
        wait_for(read_all, 60, what="every log line read")
        subprocess.run([sys.executable, "-c", WRITER, str(dumps)], check=True, timeout=60)

        def scanned() -> bool:
            seen.append(_threads(agent.proc.pid))
            return agent.metric("precision_agent_dump_files_scanned_total") == 4
        wait_for(scanned, 30, what="the dump scanned")
        seen.append(_threads(agent.proc.pid))
        assert max(seen) <= bound, f"{max(seen)} threads (samples {seen}) > {bound} documented for this config"
        assert agent.stop() == 0
    finally:
        agent.kill()

