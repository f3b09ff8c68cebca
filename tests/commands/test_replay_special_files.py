"""``replay`` of something that is not a regular file says what it is (exit 2), instead of
"no such file" for a path that exists; a missing path still says that."""

import os
import subprocess
import sys

import pytest


def replay(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precision_agent", "replay", str(path)], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("make, what", [
    (lambda d: (os.mkfifo(d / "fifo"), d / "fifo")[1], "a named pipe (FIFO)"),
    (lambda d: "/dev/zero", "a character device"),
    (lambda d: d, "a directory"),
])
def test_special_file_is_named_for_what_it_is(tmp_path, make, what):
    path = make(tmp_path)
    proc = replay(path)
    assert proc.returncode == 2
    assert f"{path}: not a regular file: it is {what}" in proc.stderr
    assert "no such file" not in proc.stderr


def test_missing_file_says_so(tmp_path):
    proc = replay(tmp_path / "absent.log")
    assert proc.returncode == 2 and "absent.log: no such file" in proc.stderr
