"""Shared test helpers: where ../shared lives, free ports, polling with a deadline, a scratch folder
in memory for tests that make tens of thousands of files, one plain install of the package per
session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PRECISION_AGENT_SHARED", REPO.parent / "shared"))
CORPUS = SHARED / "corpus"

T = TypeVar("T")


def corpus_path(*parts: str) -> Path:
    """A path inside ../shared/corpus; skips the test cleanly when the corpus is absent."""
    p = CORPUS.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"shared corpus not available at {p}")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], T], timeout: float = 15.0, interval: float = 0.05, what: str = "condition") -> T:
    """Poll ``cond`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")


RAM_DIR = Path("/dev/shm")
RAM_DIR_MIN_FREE = 1 << 30


@pytest.fixture
def many_files_dir(tmp_path: Path) -> Iterator[Path]:
    """An empty folder for tens of thousands of small files: on the tmpfs at /dev/shm where it has
    a GiB free (making and removing 50,000 files there takes seconds, on a loaded disk minutes),
    else under ``tmp_path``; removed after the test. What the agent does with the files is the same."""
    if RAM_DIR.is_dir() and os.access(RAM_DIR, os.W_OK) and shutil.disk_usage(RAM_DIR).free >= RAM_DIR_MIN_FREE:
        path = Path(tempfile.mkdtemp(prefix="precision-agent-test-", dir=RAM_DIR))
    else:
        path = tmp_path / "many"
        path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def plain_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """A plain (non-editable) install of the package with the default compiler, made once per
    session (tests/support/install.py): ``(target, pip's process)``; the target is what
    ``PYTHONPATH`` points at. The tests using it only read it."""
    from support.install import install
    target = tmp_path_factory.mktemp("plain-install") / "site"
    return target, install(target, {})
