"""A plain (non-editable) ``pip install --target`` of the package, from a copy of this checkout's
source files: what a user's ``pip install precision-agent`` puts on a host. The copy has no
build/ directory or in-place ``.so`` of the development install, which setuptools would reuse
instead of compiling. The install with the default compiler is made once per test session
(``plain_install`` in tests/conftest.py: compiling the kernels' variants takes most of a minute)
and shared by the tests that only read it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def copy_sources(dest: Path) -> Path:
    """The checkout's files that git tracks or would track (not the ignored ones) copied to ``dest``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
    return dest


def install(target: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``pip install --target target`` of a fresh copy of the sources (beside ``target``), with
    ``env`` added to the environment (``CC=false``: no compiler). Returns pip's process."""
    src = copy_sources(target.parent / "src")
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(src)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
