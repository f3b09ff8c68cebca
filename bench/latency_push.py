"""The push path of the latency bench: log line written -> alert firing on the agent's
``/api/v1/alerts``, and -> the alert received by an Alertmanager webhook.

N runs each have their own log file (``pushNNN.log``: run ``pushNNN``), already followed with a
few healthy Megatron-LM lines. One event appends a line whose ``lm loss`` is ``NAN`` to one of
them (``TrainingNonFinite``, ``for: 0s``): a new alert each time. This process then polls the
agent's ``/api/v1/alerts`` every ``poll`` seconds until the alert of that run is firing, and waits
for the real Alertmanager (the Debian package's ``prometheus-alertmanager``: ``group_wait: 0s``,
one group per run) to POST it to the webhook receiver this process runs. Both are timed from the
write, on this process's monotonic clock; the webhook's time includes the agent's push (its
``alertmanager:`` config section), Alertmanager's dispatch and the POST.

Without Alertmanager installed (PATH or ``.ci/cache/debroot``, as .ci/run unpacks it) the webhook
half is reported as not measured, with the reason; nothing stands in for it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from . import common

REPO = Path(__file__).resolve().parent.parent
AM_NAME = "prometheus-alertmanager"
AM_TEMPLATE = Path("/usr/share/prometheus/alertmanager/default.tmpl")  # Debian's build needs it
ALERT = "TrainingNonFinite"


def find_alertmanager() -> tuple[str | None, str]:
    """(binary, "") or (None, why it cannot run here)."""
    found = shutil.which(AM_NAME)
    cached = REPO / ".ci" / "cache" / "debroot" / "usr" / "bin" / AM_NAME
    if not found and cached.is_file() and os.access(cached, os.X_OK):
        found = str(cached)
    if not found:
        return None, (f"{AM_NAME} is not installed (not on PATH, not in {cached.parent}); install Debian's "
                      "prometheus-alertmanager package or run .ci/run")
    if not AM_TEMPLATE.is_file():
        return None, f"{found} cannot start: Debian's build needs {AM_TEMPLATE} (install the package)"
    return found, ""


class Webhook:
    """Alertmanager's webhook receiver: the first arrival (monotonic) of a firing alert per run."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.posts = 0
        self.lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                now = time.monotonic()
                try:
                    alerts = json.loads(body).get("alerts", [])
                except ValueError:
                    alerts = []
                with hook.lock:
                    hook.posts += 1
                    for a in alerts:
                        if a.get("status") == "firing" and a.get("labels", {}).get("alertname") == ALERT:
                            hook.first.setdefault(a["labels"].get("run", ""), now)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def arrival(self, run: str) -> float | None:
        with self.lock:
            return self.first.get(run)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Alertmanager:
    """A real Alertmanager on a free loopback port, one group per run, sent at once."""

    def __init__(self, binary: str, root: Path, hook_url: str) -> None:
        self.root = root
        cfg = root / "alertmanager.yml"
        cfg.write_text(yaml.safe_dump({
            "route": {"receiver": "hook", "group_by": ["alertname", "run"], "group_wait": "0s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": hook_url, "send_resolved": False}]}]}))
        (root / "am-data").mkdir()
        self.log = open(root / "alertmanager.log", "ab")
        last = ""
        for _ in range(3):  # the free port may be taken between probe and bind
            self.port = common.free_port()
            self.proc = subprocess.Popen(
                [binary, f"--config.file={cfg}", f"--storage.path={root / 'am-data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if common.http_get(self.port, "/-/ready", timeout=1.0)[0] == 200:
                        self.url = f"http://127.0.0.1:{self.port}"
                        return
                except OSError:
                    pass
                time.sleep(0.05)
            last = (root / "alertmanager.log").read_text(errors="replace")[-2000:]
            self.stop()
        raise common.AgentError(f"Alertmanager did not become ready:\n{last}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _firing(agent: common.AgentProcess, run: str) -> bool:
    status, body = common.http_get(agent.port, "/api/v1/alerts")
    if status != 200:
        return False
    # Parse only an answer that names the run: the bench's own JSON parse of 100 alerts with their
    # evidence every 5 ms took CPU from the agent it measures (a 2-core host); the verdict is the
    # same, from the parsed document.
    if f'"run":{json.dumps(run)}'.encode() not in body:
        return False
    return any(a.get("alertname") == ALERT and a.get("state") == "firing" and a.get("labels", {}).get("run") == run
               for a in json.loads(body)["data"]["alerts"])


def _event(agent: common.AgentProcess, hook: Webhook | None, path: Path, run: str, poll: float,
           deadline: float) -> tuple[float | None, float, float | None]:
    """Append the NaN line; (API latency or None, its lower bound, webhook latency or None)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        t0 = time.monotonic()
        os.write(fd, common.megatron_line(3, float("nan")).encode())
    finally:
        os.close(fd)
    api, lower = None, 0.0
    while time.monotonic() - t0 < deadline:
        s = time.monotonic()
        if _firing(agent, run):
            api = time.monotonic() - t0
            break
        lower = s - t0
        time.sleep(max(0.0, s + poll - time.monotonic()))
    hook_s = None
    if hook is not None:
        while time.monotonic() - t0 < deadline:
            at = hook.arrival(run)
            if at is not None:
                hook_s = at - t0
                break
            time.sleep(0.002)
    return api, lower, hook_s


def run_push(n: int, poll: float, spacing: tuple[float, float], deadline: float, rng: random.Random,
             p99: Any) -> dict[str, Any]:
    """``p99``: the percentile function of latency.py (one definition of the reported statistics)."""
    binary, why = find_alertmanager()
    root = Path(tempfile.mkdtemp(prefix="precision-agent-bench-push-"))
    logs = root / "logs"
    logs.mkdir()
    runs = [f"push{k:03d}" for k in range(n)]
    for r in runs:
        (logs / f"{r}.log").write_text(common.megatron_line(1) + common.megatron_line(2))
    hook = am = None
    try:
        if binary is not None:
            hook = Webhook()
            am = Alertmanager(binary, root, hook.url)
        cfg = root / "agent.yml"
        cfg.write_text(yaml.safe_dump({"alertmanager": {"urls": [am.url]}} if am is not None else {}))
        with common.AgentProcess(logs, extra_args=["--config", str(cfg)]) as agent:
            until = time.monotonic() + 60
            while (common.metric_values(agent.metrics(), common.METRIC + "log_lines_read_total") or [0])[0] < 2 * n:
                if time.monotonic() > until:
                    raise common.AgentError("the healthy lines were never read:\n" + agent.log_tail())
                time.sleep(0.05)
            before = agent.sample()
            api, lowers, webhook = [], [], []
            for r in runs:
                time.sleep(rng.uniform(*spacing))
                a, lo, w = _event(agent, hook, logs / f"{r}.log", r, poll, deadline)
                api.append(a)
                lowers.append(lo)
                webhook.append(w)
            after = agent.sample()
            posts = hook.posts if hook is not None else 0
    finally:
        if am is not None:
            am.stop()
        if hook is not None:
            hook.close()
        shutil.rmtree(root, ignore_errors=True)
    ok_api = [v for v in api if v is not None]
    ok_hook = [v for v in webhook if v is not None]
    out: dict[str, Any] = {
        "n": n, "poll_interval_s": poll, "alert": ALERT,
        "api": {**common.summarize(ok_api), "p99_s": p99(ok_api), "timeouts": len(api) - len(ok_api),
                "samples_s": api, "lower_bound_median_s": common.percentile(lowers, 50)},
        "agent_cpu_percent": common.cpu_percent(before, after),
        "alertmanager": binary, "alertmanager_unavailable": why or None,
    }
    if hook is not None:
        out["webhook"] = {**common.summarize(ok_hook), "p99_s": p99(ok_hook), "timeouts": len(webhook) - len(ok_hook),
                          "samples_s": webhook, "posts": posts}
    return out
