"""Run the real agent as a subprocess for tests, and write logs from another process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from conftest import free_port, wait_for

WRITER = r"""
import sys, time
path, first, last, scale, grad = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
with open(path, "a") as f:
    for it in range(first, last + 1):
        f.write(f" iteration {it:>8}/    1000 | consumed samples: {it*8:>12} | learning rate: 1.000000E-04 | "
                f"global batch size:     8 | lm loss: {5.0 - it * 0.001:.6E} | loss scale: {scale} | "
                f"grad norm: {grad} | number of skipped iterations:   0 | number of nan iterations:   0 |\n")
        f.flush()
"""


def write_megatron(path: Path, first: int, last: int, scale: str = "65536.0", grad: str = "1.5") -> None:
    """Append iterations first..last to ``path`` from a separate writer process."""
    subprocess.run([sys.executable, "-c", WRITER, str(path), str(first), str(last), scale, grad], check=True,
                   timeout=60)


class AgentProcess:
    def __init__(self, watch: Path, state: Path, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr_path = state.parent / f"agent-{self.port}.stderr"
        self.args = [sys.executable, "-m", "precision_agent", "run", "--watch", str(watch), "--listen",
                     f"127.0.0.1:{self.port}", "--state", str(state), *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, env: dict[str, str] | None = None) -> "AgentProcess":
        self._err = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=self._err,
                                     env={**os.environ, **(env or {})})
        wait_for(self.ready, 30, what=f"agent ready; stderr:\n{self.stderr()}")
        return self

    def ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.stderr()}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return r.read().decode()

    def alerts(self) -> list[dict]:
        return json.loads(self.get("/api/v1/alerts"))["data"]["alerts"]

    def metric(self, name: str, **labels: str) -> float | None:
        """Value of the first sample of ``name`` whose labels include ``labels``."""
        for line in self.get("/metrics").splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                return float(value)
        return None

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if getattr(self, "_err", None):
            self._err.close()
