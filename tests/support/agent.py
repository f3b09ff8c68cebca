"""Run the real agent as a subprocess for tests, and write logs from another process."""

from __future__ import annotations

import base64
import shutil
import socket
import ssl
import tempfile
import time

import pytest

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

    def start(self, env: dict[str, str] | None = None, preexec_fn=None) -> "AgentProcess":
        """``preexec_fn``: run in the child before exec (e.g. resource.setrlimit for a low ulimit)."""
        self._err = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=self._err,
                                     env={**os.environ, **(env or {})}, preexec_fn=preexec_fn)
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


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it, with the openssl CLI."""
    if shutil.which("openssl") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("openssl CLI missing under CI=true (.ci/run installs it)")
        pytest.skip("openssl CLI not installed")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=test-ca", "-days", "2")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.ext")
    for name in ("scraper", "intruder"):  # client certificates for mutual TLS
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text(f"subjectAltName=DNS:{name}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    return d / "ca.crt", d / "server.crt", d / "server.key"


def bcrypt_hash(password: str) -> str:
    import bcrypt
    h = bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
    return "$2y$" + h[4:]  # the prefix htpasswd writes, as operators' files have it


class TlsAgent(AgentProcess):
    ctx: ssl.SSLContext
    auth: str

    def ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.stderr()}")
        try:
            return self.fetch("/-/ready", self.auth)[0] == 200
        except (urllib.error.URLError, OSError):
            return False

    def fetch(self, path: str, auth: str | None, scheme: str = "https") -> tuple[int, bytes]:
        req = urllib.request.Request(f"{scheme}://127.0.0.1:{self.port}{path}")
        if auth is not None:
            req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=5, context=self.ctx if scheme == "https" else None) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


class FakeSystemd:
    """The receiving end of sd_notify: every datagram, split into its KEY=VALUE lines."""

    def __init__(self, directory: Path) -> None:
        path = directory / "notify.sock"
        self.own_dir: Path | None = None
        if len(str(path)) > 100:  # sun_path is 108 bytes
            self.own_dir = Path(tempfile.mkdtemp(prefix="pa-notify-"))
            path = self.own_dir / "n.sock"
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, list[str]]] = []

    def pump(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except (socket.timeout, BlockingIOError):
                return
            self.messages.append((time.monotonic(), data.decode().split("\n")))

    def lines(self) -> list[str]:
        self.pump()
        return [line for _, msg in self.messages for line in msg]

    def count(self, line: str) -> int:
        return self.lines().count(line)

    def index(self, line: str) -> int:
        """Position of the first datagram containing ``line`` (-1 if none yet)."""
        self.pump()
        return next((i for i, (_, msg) in enumerate(self.messages) if line in msg), -1)

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)
