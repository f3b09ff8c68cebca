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
