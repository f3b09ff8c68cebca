"""A one-shot command's exit: the objects left are frozen out of the garbage collector's sight
before the interpreter's last collections (commands/tools.py ``freeze_at_exit``), and the exit
otherwise stays as it was: exit handlers run, the output is whole, the exit status kept."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

# a handler registered before the command: atexit runs last-in first-out, so it runs after the
# command's own and sees what they left
PROBE = """
import atexit, gc, sys
atexit.register(lambda: sys.stderr.write(f"FROZEN {gc.get_freeze_count()}\\n"))
from precision_agent.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, timeout=120)


def test_a_scan_exits_with_the_objects_frozen_and_its_output_whole(tmp_path):
    a = np.arange(64, dtype=np.float32)
    a[3] = np.inf
    np.save(tmp_path / "layer0.output.0.npy", a)
    p = _run("scan", "--json", tmp_path)
    assert p.returncode == 1, p.stderr                    # the Inf pages: the status survives the exit
    doc = json.loads(p.stdout)                            # the whole document, flushed before the exit
    assert doc["first_nonfinite"]["op"] and doc["findings"]
    frozen = [int(line.split()[1]) for line in p.stderr.splitlines() if line.startswith("FROZEN ")]
    assert frozen and frozen[0] > 10_000                  # the imports' objects, out of the last collections


def test_a_failing_command_freezes_at_exit_too_and_keeps_its_status(tmp_path):
    p = _run("scan", tmp_path / "missing")
    assert p.returncode == 2 and "no such file or directory" in p.stderr
    assert any(line.startswith("FROZEN ") and int(line.split()[1]) > 0 for line in p.stderr.splitlines())
