"""The one-shot commands run as a user runs them: a subprocess of ``python -m precision_agent``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def replay_json(path: Path | str) -> dict[str, Any]:
    """``precision-agent replay --json PATH``; its exit status must agree with its findings
    (README: 1 when a page or critical finding is reported, else 2 when no record was recognised
    in the file, else 0)."""
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "replay", "--json", str(path)],
                          capture_output=True, text=True, timeout=120)
    r = json.loads(proc.stdout)
    paging = any(f["severity"] in ("page", "critical") for f in r["findings"])
    assert proc.returncode == (1 if paging else 2 if r["unrecognized"] else 0), proc.stderr
    return r


# the command line run in a fresh interpreter, in-process (``main``), as a user runs it: its exit
# status and output, and every module it loaded
_PROBE = """
import io, json, sys
from precision_agent.commands.cli import main
out, sys.stdout = sys.stdout, io.StringIO()
try:
    rc = main(sys.argv[1:])
finally:
    doc, sys.stdout = sys.stdout.getvalue(), out
print(json.dumps({"rc": rc, "out": doc, "modules": sorted(sys.modules)}))
"""


def cli_modules(*args: object) -> tuple[int, str, set[str], str]:
    """``precision-agent ARGS`` in a fresh interpreter: (exit status, stdout, the modules it
    imported, stderr)."""
    p = subprocess.run([sys.executable, "-c", _PROBE, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    return got["rc"], got["out"], set(got["modules"]), p.stderr
