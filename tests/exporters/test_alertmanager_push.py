"""The Alertmanager v2 pusher against a real Alertmanager (Debian's 0.25) and small stdlib servers.

Alerts come from the real pipeline and shipped rules (a loss-scale collapse), so the labels and
annotations are those the daemon would push. Alertmanager routes everything to a webhook sink in
this process with ``send_resolved``, which shows the ``endsAt`` of a resolved alert. Every wait
is a poll with a deadline.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from pydantic import ValidationError

from conftest import wait_for
from support.prom import get_json, http_get, megatron_line, running_alertmanager, start_listening, stop_all
from support.prom import WebhookSink

from precision_agent.exporters.alertmanager import (AlertmanagerCollector, AlertmanagerConfig,
                                                    AlertmanagerPusher, rfc3339)
from precision_agent.model import LOSS_SCALE, Alert, AlertState, Sample, SourcePos, make_labels
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import default_rules_dir, default_runbook_base, load_rules


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Job:
    """A training run seen through the real pipeline: its loss scale drives LossScaleAtFloor."""

    def __init__(self, run: str) -> None:
        self.pipeline = Pipeline(load_rules([default_rules_dir()]))
        self.labels = make_labels(run=run, rank="0")
        self.step = 0

    def scale(self, value: float) -> float:
        self.step += 1
        now = time.time()
        self.pipeline.process([Sample(self.labels, LOSS_SCALE, value, self.step,
                                      SourcePos("/data/train.log", self.step), time=now)])
        self.pipeline.tick(now)
        return now

    def alerts(self) -> list[Alert]:
        return list(self.pipeline.alerts.alerts.values())


@pytest.fixture(scope="module")
def am(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, WebhookSink]]:
    sink = WebhookSink()
    config = {"route": {"receiver": "hook", "group_by": ["alertname", "run"], "group_wait": "0s",
                        "group_interval": "1s", "repeat_interval": "1h"},
              "receivers": [{"name": "hook", "webhook_configs": [
                  {"url": f"http://127.0.0.1:{sink.port}/hook", "send_resolved": True}]}]}
    try:
        with running_alertmanager(config, tmp_path_factory.mktemp("am")) as url:
            yield url, sink
    finally:
        sink.close()


def _am_alerts(url: str, run: str) -> list[dict[str, Any]]:
    return [a for a in get_json(f"{url}/api/v2/alerts") if a["labels"].get("run") == run]


def _pusher(*urls: str, **kw: Any) -> AlertmanagerPusher:
    cfg = AlertmanagerConfig.model_validate({"urls": list(urls), **kw})
    p = AlertmanagerPusher(cfg, instance="host-a", generator_url="http://host-a:19400")
    p.start()
    return p


@pytest.mark.e2e
def test_firing_then_resolved_in_alertmanager(am: tuple[str, WebhookSink]) -> None:
    url, sink = am
    job, pusher = Job("r-fire"), _pusher(url, resend_interval="1m", external_labels={"cluster": "c1"})
    try:
        job.scale(2.0)
        pusher.sync(job.alerts(), time.time())
        assert pusher.stats()["sent"] == 0   # nothing firing yet: nothing to say
        sent_at = job.scale(1.0)            # a back-off to the floor: LossScaleAtFloor fires
        pusher.sync(job.alerts(), sent_at)
        got = wait_for(lambda: _am_alerts(url, "r-fire"), 15, what="the alert in Alertmanager")
        assert len(got) == 1
        a = got[0]
        assert a["labels"] == {"alertname": "LossScaleAtFloor", "run": "r-fire", "rank": "0",
                               "severity": "page", "instance": "host-a", "cluster": "c1", "suspect": "unknown"}
        assert a["annotations"]["summary"] == "Loss scale fell to 1 (floor 1) at step 2"
        assert a["annotations"]["runbook_url"] == default_runbook_base() + "/LossScaleAtFloor.md"
        assert a["generatorURL"] == "http://host-a:19400/api/v1/alerts"
        assert a["status"]["state"] == "active"
        # endsAt is the lifetime (4 x resend_interval) ahead of the send, so a dead agent's alert expires
        assert abs(_ts(a["endsAt"]) - (sent_at + 240)) < 1.0, a
        assert abs(_ts(a["startsAt"]) - sent_at) < 0.01, a

        resolved_at = job.scale(65536.0)    # the scale recovered: the alert resolves
        [alert] = job.alerts()
        assert alert.state == AlertState.RESOLVED
        pusher.sync(job.alerts(), resolved_at + 0.5)
        wait_for(lambda: not _am_alerts(url, "r-fire"), 15, what="the alert gone from the active list")

        def resolved_notice() -> list[dict[str, Any]]:
            return [x for p in sink.payloads("/hook") for x in p["alerts"]
                    if x["labels"].get("run") == "r-fire" and x["status"] == "resolved"]

        [notice] = wait_for(resolved_notice, 15, what="the resolved notification at the webhook")
        # the resolve time, not the sync time (compared as times: Go drops trailing zeros, ".120Z" -> ".12Z")
        assert abs(_ts(notice["endsAt"]) - _ts(rfc3339(alert.resolved_at))) < 1e-6, notice
        assert pusher.stats() == {"sent": 2, "failed": 0, "dropped": 0, "pending": 0}
    finally:
        pusher.stop()


@pytest.mark.e2e
def test_resends_refresh_endsat_and_a_silent_agent_expires(am: tuple[str, WebhookSink]) -> None:
    url, _sink = am
    job, pusher = Job("r-resend"), _pusher(url, resend_interval="1s", lifetime="3s")
    try:
        job.scale(2.0)
        t0 = job.scale(1.0)
        pusher.sync(job.alerts(), t0)
        first = wait_for(lambda: _am_alerts(url, "r-resend"), 15, what="the alert in Alertmanager")[0]
        assert abs(_ts(first["endsAt"]) - (t0 + 3)) < 1.0
        pusher.sync(job.alerts(), t0 + 0.5)   # within the resend interval: nothing to send
        assert wait_for(lambda: pusher.stats()["pending"] == 0, 10, what="queue drained")
        assert pusher.stats()["sent"] == 1
        pusher.sync(job.alerts(), time.time() + 1.5)   # resend due: endsAt moves forward
        wait_for(lambda: pusher.stats()["sent"] == 2, 10, what="the resend")
        later = wait_for(lambda: [a for a in _am_alerts(url, "r-resend")
                                  if _ts(a["endsAt"]) > _ts(first["endsAt"]) + 1], 10,
                         what="endsAt refreshed in Alertmanager")[0]
        assert later["fingerprint"] == first["fingerprint"]
    finally:
        pusher.stop()
    # the agent is gone: no resend, so Alertmanager lets the alert expire at its endsAt
    wait_for(lambda: not _am_alerts(url, "r-resend"), 20, what="the alert expired in Alertmanager")


class Quirky:
    """Stdlib server: /hold/... answers only once released, /bad/... answers 400, /auth/... 200
    and records the Authorization header."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.release = threading.Event()
        self.holding = threading.Event()
        self.auth: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                json.loads(body)
                if self.path.startswith("/hold/"):
                    outer.holding.set()
                    outer.release.wait(30)
                code = 400 if self.path.startswith("/bad/") else 200
                outer.auth.append(self.headers.get("Authorization"))
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _firing(run: str) -> Job:
    job = Job(run)
    job.scale(2.0)
    job.scale(1.0)  # a dynamic scaler backed off to its floor: LossScaleAtFloor fires
    return job


def test_unreachable_alertmanager_is_counted_and_retried() -> None:
    with socket.socket() as s:   # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    job = _firing("r-dead")
    pusher = _pusher(dead, retry_backoff="50ms", max_backoff="200ms", timeout="2s")
    try:
        pusher.sync(job.alerts(), time.time())
        wait_for(lambda: pusher.stats()["failed"] >= 3, 15, what="retried failures")
        st = pusher.stats()
        assert st["sent"] == 0 and st["dropped"] == 0 and st["pending"] == 1, st  # kept for the next try
    finally:
        pusher.stop()


def test_a_hanging_alertmanager_blocks_neither_sync_nor_other_urls() -> None:
    srv = Quirky()
    job = _firing("r-hang")
    pusher = _pusher(f"{srv.url}/hold", f"{srv.url}/ok", timeout="20s")
    try:
        pusher.sync(job.alerts(), time.time())
        wait_for(srv.holding.is_set, 10, what="the request held by the hanging server")
        second = Job("r-hang-2")
        second.scale(2.0)
        second.scale(1.0)
        pusher.sync(job.alerts() + second.alerts(), time.time())  # returns while a request is in flight
        assert not srv.release.is_set()
        # the healthy URL got both alerts meanwhile; the hanging one keeps both queued (one in flight)
        wait_for(lambda: pusher.stats()["sent"] == 2, 10, what="both alerts sent to the healthy URL")
        assert pusher.stats()["pending"] == 2
        srv.release.set()
        wait_for(lambda: pusher.stats() == {"sent": 4, "failed": 0, "dropped": 0, "pending": 0}, 10,
                 what="the held URL caught up")
    finally:
        pusher.stop()
        srv.close()


def test_refused_batch_is_dropped_and_queue_is_bounded() -> None:
    srv = Quirky()
    pusher = _pusher(f"{srv.url}/bad")
    try:
        pusher.sync(_firing("r-bad").alerts(), time.time())
        wait_for(lambda: pusher.stats()["dropped"] == 1, 10, what="a 400 answer dropping the batch")
        assert pusher.stats()["failed"] == 1 and pusher.stats()["pending"] == 0
    finally:
        pusher.stop()
        srv.close()
    # never started: nothing drains, so the queue's bound is what keeps memory flat
    pusher = AlertmanagerPusher(AlertmanagerConfig(urls=[srv.url], queue_size=2), instance="h")
    pusher.sync([a for r in ("q1", "q2", "q3") for a in _firing(r).alerts()], time.time())
    assert pusher.stats() == {"sent": 0, "failed": 0, "dropped": 1, "pending": 2}
    collected = {m.name: m.samples[0].value for m in AlertmanagerCollector(pusher).collect()}
    assert collected == {"precision_agent_alertmanager_alerts_sent": 0,
                         "precision_agent_alertmanager_requests_failed": 0,
                         "precision_agent_alertmanager_alerts_dropped": 1,
                         "precision_agent_alertmanager_queue_length": 2}


def test_credentials_are_sent_and_read_at_each_request(tmp_path: Path) -> None:
    srv = Quirky()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    job = _firing("r-auth")
    pusher = _pusher(f"{srv.url}/auth", bearer_token_file=str(token), resend_interval="1s")
    try:
        t0 = time.time()
        pusher.sync(job.alerts(), t0)
        wait_for(lambda: srv.auth, 10, what="the first push")
        token.write_text("rotated")
        pusher.sync(job.alerts(), t0 + 2)   # resend, with the rotated token
        wait_for(lambda: len(srv.auth) == 2, 10, what="the resend")
        assert srv.auth == ["Bearer s3cret", "Bearer rotated"]
    finally:
        pusher.stop()
    pw = tmp_path / "pw"
    pw.write_text("hunter2")
    pusher = _pusher(f"{srv.url}/auth", basic_auth={"username": "agent", "password_file": str(pw)})
    try:
        pusher.sync(job.alerts(), time.time())
        wait_for(lambda: len(srv.auth) == 3, 10, what="the basic-auth push")
        assert srv.auth[2] == "Basic YWdlbnQ6aHVudGVyMg=="   # agent:hunter2
    finally:
        pusher.stop()
        srv.close()


def test_tls_with_ca_file(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if not openssl:
        pytest.skip("openssl(1) not available to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True, timeout=60)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv = Quirky(tls=ctx)
    job = _firing("r-tls")
    untrusted = _pusher(srv.url + "/x", retry_backoff="10s")
    trusted = _pusher(srv.url + "/x", ca_file=str(cert))
    try:
        untrusted.sync(job.alerts(), time.time())
        trusted.sync(job.alerts(), time.time())
        wait_for(lambda: trusted.stats()["sent"] == 1, 10, what="the push trusting the CA file")
        wait_for(lambda: untrusted.stats()["failed"] == 1, 10, what="the push without the CA failing")
        assert untrusted.stats()["sent"] == 0
    finally:
        trusted.stop()
        untrusted.stop()
        srv.close()


@pytest.mark.parametrize("bad, field", [
    ({"urls": []}, "urls"),
    ({"urls": ["ftp://am:9093"]}, "urls.0"),
    ({"urls": ["http://am:9093"], "resend_interval": 0}, "resend_interval"),
    ({"urls": ["http://am:9093"], "resend_interval": "1m", "lifetime": "30s"}, ""),
    ({"urls": ["http://am:9093"], "bearer_token_file": "/nonexistent/token"}, "bearer_token_file"),
    ({"urls": ["http://am:9093"], "basic_auth": {"username": "u"}}, "basic_auth"),
    ({"urls": ["http://am:9093"], "external_labels": {"bad-name": "x"}}, "external_labels"),
    ({"urls": ["http://am:9093"], "timeout": "soon"}, "timeout"),
    ({"urls": ["http://am:9093"], "unknown": 1}, "unknown"),
])
def test_config_rejects(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        AlertmanagerConfig.model_validate(bad)
    assert ".".join(str(p) for p in exc.value.errors()[0]["loc"]) == field


def test_config_defaults() -> None:
    cfg = AlertmanagerConfig(urls=["http://am:9093/prefix"])
    assert (cfg.resend_interval, cfg.alert_lifetime, cfg.timeout, cfg.backoff_cap) == (60, 240, 10, 60)
    p = AlertmanagerPusher(cfg, instance="h")
    assert p._targets[0].url == "http://am:9093/prefix/api/v2/alerts"


@pytest.mark.e2e
def test_daemon_pushes_to_alertmanager(am: tuple[str, WebhookSink], tmp_path: Path) -> None:
    """The real daemon with an ``alertmanager:`` section: a collapse in a log it follows pages
    through Alertmanager without Prometheus, and the push counters are on /metrics."""
    from precision_agent.config import Config
    if "alertmanager" not in Config.model_fields:
        pytest.skip("agent/config/ has no alertmanager section yet (integration not wired)")
    url, _sink = am
    (tmp_path / "logs").mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text(yaml.safe_dump({
        "watches": [{"path": str(tmp_path / "logs"), "labels": {"run": "r-daemon"}}],
        "limits": {"nice": 0, "io_idle": False},
        "alertmanager": {"urls": [url], "resend_interval": "1m", "external_labels": {"instance": "node-7"}}}))
    agent, port = start_listening("agent", lambda p: [
        sys.executable, "-m", "precision_agent", "run", "--listen", f"127.0.0.1:{p}",
        "--state", str(tmp_path / "state"), "--config", str(cfg)], tmp_path)
    try:
        with open(tmp_path / "logs" / "train.log", "w", encoding="utf-8") as f:
            for it, scale in enumerate((2.0, 1.0), start=1):  # one back-off, to the floor
                f.write(megatron_line(it, 10, scale) + "\n")
        [a] = wait_for(lambda: _am_alerts(url, "r-daemon"), 20, what="the daemon's alert in Alertmanager")
        assert a["labels"] == {"alertname": "LossScaleAtFloor", "run": "r-daemon", "severity": "page",
                               "instance": "node-7", "suspect": "unknown"}
        assert a["generatorURL"] == f"http://127.0.0.1:{port}/api/v1/alerts"
        status, body = http_get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and "precision_agent_alertmanager_alerts_sent_total 1.0" in body.decode()
    finally:
        assert not stop_all([agent])


@pytest.mark.e2e
def test_daemon_pushes_fusion_suspected_from_a_dump_watch(am: tuple[str, WebhookSink], tmp_path: Path) -> None:
    """Issue 11: dump watch -> first bad op inside a fused API -> FusionSuspected at a real
    Alertmanager, with the API in the alert."""
    url, _sink = am
    (tmp_path / "dumps").mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text(yaml.safe_dump({
        "watches": [{"path": str(tmp_path / "dumps"), "kind": "dump", "labels": {"run": "r-fusion"}}],
        "dump_settle": "0.5s", "limits": {"nice": 0, "io_idle": False},
        "alertmanager": {"urls": [url], "resend_interval": "1m"}}))
    agent, port = start_listening("agent", lambda p: [
        sys.executable, "-m", "precision_agent", "run", "--listen", f"127.0.0.1:{p}",
        "--state", str(tmp_path / "state"), "--config", str(cfg)], tmp_path)
    try:
        from support.fusion import WRITER
        subprocess.run([sys.executable, "-c", WRITER, str(tmp_path / "dumps"), str(Path(__file__).resolve().parents[1])],
                       check=True, timeout=60)
        got = wait_for(lambda: [a for a in _am_alerts(url, "r-fusion") if a["labels"]["alertname"] == "FusionSuspected"],
                       30, what="FusionSuspected in Alertmanager")
        (a,) = got
        assert a["labels"]["op"] == "NPU.npu_fusion_attention.0.forward" and a["labels"]["severity"] == "ticket"
        assert "npu_fusion_attention" in a["annotations"]["summary"]
    finally:
        assert not stop_all([agent])
