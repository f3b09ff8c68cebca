"""Helpers for the tests that run the real Prometheus / Alertmanager binaries (Debian packages).

Not a conftest: the tests import it explicitly. Everything listens on 127.0.0.1 only, every wait
is a poll with a deadline, and every process is stopped SIGTERM -> wait -> SIGKILL.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "exporters" / "prometheus"
DEBROOT_BIN = REPO / ".ci" / "cache" / "debroot" / "usr" / "bin"

T = TypeVar("T")


class ProcessDied(AssertionError):
    """A process the test depends on exited: waiting any longer is pointless."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def find_binary(name: str) -> str:
    """Path of a Prometheus-stack binary: PATH first, then the CI cache of unpacked debs.

    Missing: skip with the reason, except under CI=true, where the e2e tests must really run.
    """
    found = shutil.which(name)
    if not found:
        candidate = DEBROOT_BIN / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            found = str(candidate)
    if found:
        return found
    reason = (f"{name} not found on PATH nor in {DEBROOT_BIN}; install Debian's prometheus and "
              "prometheus-alertmanager packages, or run .ci/run, which unpacks them there")
    if in_ci():
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    """A loopback port that was free a moment ago (the kernel's choice, so collisions are rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2,
               on_timeout: Callable[[], str] | None = None) -> T:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` at the deadline.

    Exceptions raised by the predicate count as "not yet" (a server that is still starting
    refuses connections); the last one is reported if the deadline passes. ``ProcessDied`` ends
    the wait at once. ``on_timeout`` returns diagnostics (process logs) for the failure message.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    last: Any = None
    while True:
        try:
            last = predicate()
            if last:
                return last
        except ProcessDied as exc:
            extra = on_timeout() if on_timeout is not None else ""
            if extra in str(exc):   # the dead process's log is already in the message
                extra = ""
            raise ProcessDied(f"{exc}\nwhile waiting for {what}\n{extra}".rstrip()) from None
        except Exception as exc:  # noqa: BLE001 - reported below
            last_exc = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    msg = f"timed out after {timeout:.0f}s waiting for {what}; last result {last!r}"
    if last_exc is not None:
        msg += f"; last error {type(last_exc).__name__}: {last_exc}"
    if on_timeout is not None:
        msg += "\n" + on_timeout()
    raise AssertionError(msg)


def wait_alive(procs: Sequence["Proc"], predicate: Callable[[], T], timeout: float, what: str,
               on_timeout: Callable[[], str] | None = None) -> T:
    """``wait_until`` that gives up at once when one of ``procs`` exited."""
    def checked() -> T:
        for p in procs:
            p.check_alive()
        return predicate()
    return wait_until(checked, timeout, what, interval=0.25, on_timeout=on_timeout)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_json(url: str, timeout: float = 2.0) -> Any:
    status, body = http_get(url, timeout)
    if status != 200:
        raise RuntimeError(f"GET {url}: HTTP {status}: {body[:300]!r}")
    return json.loads(body)


def is_ready(url: str) -> bool:
    return http_get(url, timeout=1.0)[0] == 200


def prom_query(base: str, expr: str) -> list[dict[str, Any]]:
    """Instant query against Prometheus' HTTP API; the result vector."""
    doc = get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


class Proc:
    """A subprocess whose stdout+stderr go to a log file; stopped SIGTERM -> wait -> SIGKILL."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise ProcessDied(f"{self.name} exited with status {self.popen.returncode}\n{self.tail()}")

    def tail(self, n_bytes: int = 6000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError as exc:
            return f"----- {self.name}: log unreadable: {exc}"
        text = data[-n_bytes:].decode("utf-8", "replace")
        state = "running" if self.alive() else f"exited {self.popen.returncode}"
        return f"----- {self.name} (pid {self.pid}, {state}) log tail, {self.log_path}:\n{text}"

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit status."""
        try:
            if self.popen.poll() is None:
                self.popen.send_signal(signal.SIGTERM)
                try:
                    self.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait(5)
        finally:
            self._log.close()
        return self.popen.returncode


def stop_all(procs: Sequence[Proc]) -> list[str]:
    """Stop every process (last started first) even if one of them fails to stop. All are told
    (SIGTERM) before any is waited for, so a fleet shuts down in parallel."""
    problems = []
    for p in reversed(procs):
        try:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        except OSError:
            pass  # gone already; stop() below reports what it finds
    for p in reversed(procs):
        try:
            p.stop()
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            problems.append(f"{p.name}: {exc}")
    return problems


AM_TEMPLATE_DIR = Path("/usr/share/prometheus/alertmanager")


def alertmanager_wrapper(am_binary: str) -> tuple[list[str], str]:
    """Argv prefix that makes Debian's alertmanager find its default template, or a reason why not.

    Debian's build reads ``default.tmpl`` from the absolute path /usr/share/prometheus/alertmanager
    and exits at start-up without it. An installed package has it; a deb merely unpacked with
    ``dpkg-deb -x`` (what .ci/run does) has it only under its unpack root. Then the alertmanager
    runs in a private mount namespace where a read-only overlay adds the unpacked
    usr/share to /usr/share (nothing on the machine changes).
    """
    if (AM_TEMPLATE_DIR / "default.tmpl").is_file():
        return [], ""
    share = Path(am_binary).resolve().parent.parent / "share"
    if not (share / "prometheus" / "alertmanager" / "default.tmpl").is_file():
        return [], f"alertmanager's default.tmpl is neither in {AM_TEMPLATE_DIR} nor in {share}"
    unshare = shutil.which("unshare")
    if not unshare:
        return [], f"{AM_TEMPLATE_DIR}/default.tmpl missing and no unshare(1) to overlay {share}"
    ns = [unshare, "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        ns.insert(1, "--map-root-user")
    mount = f"mount -t overlay overlay -o lowerdir={share}:/usr/share /usr/share"
    probe = subprocess.run([*ns, "sh", "-c", f"{mount} && test -f {AM_TEMPLATE_DIR}/default.tmpl"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return [], (f"{AM_TEMPLATE_DIR}/default.tmpl missing and overlaying {share} in a mount "
                    f"namespace failed: {probe.stderr.strip()}")
    return [*ns, "sh", "-c", f'{mount} && exec "$0" "$@"'], ""


def start_listening(name: str, argv_for: Callable[[int], Sequence[str]], log_dir: Path,
                    ready_path: str = "/-/ready", timeout: float = 20.0, attempts: int = 3,
                    env: dict[str, str] | None = None) -> tuple[Proc, int]:
    """Start a server on a free loopback port and wait for ``ready_path`` to answer 200.

    ``free_port`` can race with other processes on the machine; if the server dies saying the
    address is in use, it is started again on another port.
    """
    for attempt in range(1, attempts + 1):
        port = free_port()
        proc = Proc(name, argv_for(port), log_dir, env=env)
        url = f"http://127.0.0.1:{port}{ready_path}"

        def ready() -> bool:
            proc.check_alive()
            return is_ready(url)

        try:
            wait_until(ready, timeout, f"{name} ready at {url}", on_timeout=proc.tail)
            return proc, port
        except ProcessDied:
            proc.stop()
            log = proc.log_path.read_text(errors="replace").lower()
            if attempt < attempts and "address already in use" in log:
                proc.log_path.rename(proc.log_path.with_suffix(f".attempt{attempt}.log"))
                continue
            raise
        except BaseException:
            proc.stop()
            raise
    raise AssertionError("unreachable")


def megatron_line(it: int, total: int, scale: float, loss: float = 6.123456, grad_norm: str = "2.513",
                  skipped: int = 0) -> str:
    """One Megatron-LM iteration line, as the agent's parser expects it."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    return (f" [{stamp}] iteration {it:>8}/{total:>8} | consumed samples: {it * 256:>12} | "
            f"elapsed time per iteration (ms): 412.3 | learning rate: 3.000000E-04 | "
            f"global batch size:   256 | lm loss: {loss:.6E} | loss scale: {scale:.1f} | "
            f"grad norm: {grad_norm} | number of skipped iterations: {skipped:>3} | "
            f"number of nan iterations:   0 |")


def append_megatron(path: Path, first: int, scales: Sequence[float], total: int = 100,
                    pause: float = 0.05) -> None:
    """Append one Megatron line per loss scale, flushing each (a training job writing its log)."""
    with open(path, "a", encoding="utf-8") as f:
        for i, scale in enumerate(scales):
            it = first + i
            f.write(megatron_line(it, total, scale, loss=6.0 - 0.01 * it,
                                  skipped=1 if i and scale < scales[i - 1] else 0) + "\n")
            f.flush()
            time.sleep(pause)


if __name__ == "__main__":
    # The "training job" of the e2e test runs as its own process:
    #   python prom.py LOGFILE FIRST_ITERATION SCALE[,SCALE...] [PAUSE_S]
    import sys
    args = sys.argv[1:]
    append_megatron(Path(args[0]), int(args[1]), [float(s) for s in args[2].split(",")],
                    pause=float(args[3]) if len(args) > 3 else 0.05)


@contextmanager
def running_alertmanager(config: dict[str, Any], root: Path) -> Iterator[str]:
    """A real Alertmanager on 127.0.0.1 with ``config`` (its data under ``root``), yielding its URL;
    skipped where it cannot run, and a failure then under CI=true."""
    import yaml
    binary = find_binary("prometheus-alertmanager")
    wrapper, why = alertmanager_wrapper(binary)
    if why:
        if in_ci():
            pytest.fail(f"CI=true but Alertmanager cannot run: {why}", pytrace=False)
        pytest.skip(f"Alertmanager cannot run: {why}")
    cfg = root / "alertmanager.yml"
    cfg.write_text(yaml.safe_dump(config))
    (root / "data").mkdir()
    proc, port = start_listening("alertmanager", lambda p: [
        *wrapper, binary, f"--config.file={cfg}", f"--storage.path={root / 'data'}",
        f"--web.listen-address=127.0.0.1:{p}", "--cluster.listen-address=", "--log.level=info"], root)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        assert not stop_all([proc])


class WebhookSink:
    """Alertmanager webhook receiver on 127.0.0.1 (port chosen by the kernel), in a thread."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.first_at: dict[str, float] = {}   # path -> time.monotonic() of the first POST
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"unparsable": body.decode("utf-8", "replace")}
                with sink.lock:
                    sink.received.append((self.path, payload))
                    sink.first_at.setdefault(self.path, time.monotonic())
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="webhook-sink", daemon=True)
        self.thread.start()

    def payloads(self, path: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [p for (pth, p) in self.received if path is None or pth == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
