"""Append lines to a file from another process, one flush each, as syslog or a trainer writes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
