"""The whole stack for the e2e tests that run it (tests/e2e/test_fleet.py, tests/e2e/test_hardware_verdict.py):
copies of the shipped Prometheus rules and Alertmanager configuration, a real Prometheus scraping
and evaluating every second, the simulated training job (tests/support/fleet_job.py), and a
file-served exporter: a static text exposition on a loopback port, which the test can change
between scrapes (a DCGM exporter or Ascend npu-exporter as Prometheus sees it)."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from support.prom import PROM_DIR, REPO, Proc, find_binary, start_listening

FLEET_JOB = Path(__file__).resolve().parent / "fleet_job.py"


def shipped_alertmanager_config(sink_port: int, **route: str) -> dict[str, Any]:
    """The shipped alertmanager.yml with its placeholder webhooks pointed at a sink on ``sink_port``
    (same paths) and the root route's timers replaced by ``route`` (group_wait=..., ...)."""
    cfg = yaml.safe_load((REPO / "exporters" / "alertmanager" / "alertmanager.yml").read_text())
    for r in cfg["receivers"]:
        for hook in r.get("webhook_configs", []):
            hook["url"] = f"http://127.0.0.1:{sink_port}/" + hook["url"].split("/", 3)[3]
    cfg["route"].update(route)
    return cfg


def shipped_prom_rules(dest: Path, window: tuple[str, str] | None = None, expected: int | None = None) -> Path:
    """A copy of alerts.yml at ``dest``; with ``window`` = (shipped, here), that range (the memory of
    an incident's origin and of its verdict) is shortened in every rule using it, ``expected`` of them."""
    doc = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    changed = 0
    for g in doc["groups"]:
        for r in g["rules"]:
            if window and window[0] in r.get("expr", ""):
                r["expr"] = r["expr"].replace(*window)
                changed += 1
    assert expected is None or changed == expected, changed
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


def start_prometheus(root: Path, rules: Path, am_url: str, scrape_configs: list[dict[str, Any]]) -> tuple[Proc, str]:
    """A real Prometheus (data and log under ``root``) scraping and evaluating every second,
    sending to the Alertmanager at ``am_url``; its process and URL."""
    prometheus = find_binary("prometheus")
    cfg = root / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am_url.split("//")[1]]}]}]},
        "scrape_configs": scrape_configs}))
    (root / "prom").mkdir()
    proc, port = start_listening("prometheus", lambda p: [
        prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={root / 'prom'}",
        f"--web.listen-address=127.0.0.1:{p}", f"--web.external-url=http://127.0.0.1:{p}",
        "--storage.tsdb.retention.time=1h", "--rules.alert.resend-delay=1s"], root)
    return proc, f"http://127.0.0.1:{port}"


def fleet_job(root: Path, run: str, hosts: int, per_host: int, first: int, last: int, pause: float = 0.0,
              nan_from: dict[int, int] | None = None) -> subprocess.Popen:
    """tests/support/fleet_job.py as its own process (its docstring says what it writes)."""
    args = [sys.executable, str(FLEET_JOB), str(root), run, str(hosts), str(per_host), str(first), str(last),
            str(pause), *(f"{r}={s}" for r, s in (nan_from or {}).items())]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(p: subprocess.Popen) -> None:
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out.decode(errors="replace")


class Exposition:
    """Serves ``text`` (Prometheus text format) at http://127.0.0.1:PORT/metrics from a thread."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lock = threading.Lock()
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                with served.lock:
                    body = served.text.encode()
                self.send_response(200 if self.path.split("?")[0] == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="exposition", daemon=True)
        self.thread.start()

    def set(self, text: str) -> None:
        with self.lock:
            self.text = text

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
