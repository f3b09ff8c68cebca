"""Shared test helpers: where ../shared lives, free ports, polling with a deadline."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Callable, TypeVar

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
