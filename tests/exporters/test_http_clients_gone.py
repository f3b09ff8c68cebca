"""Clients that leave early and clients that flood wrong passwords, against the real daemon over
TLS: a client gone mid-response is counted and logged at debug (no traceback), and failed
logins cannot buy a bcrypt check each (429 beyond a small budget, a cached scraper unaffected)."""

from __future__ import annotations

import socket
import ssl
import struct
import time
from pathlib import Path

import yaml

from conftest import wait_for
from support.agent import TlsAgent, bcrypt_hash, make_certs


def tls_agent(tmp_path: Path, web: dict) -> TlsAgent:
    ca, crt, key = make_certs(tmp_path)
    (tmp_path / "web.yml").write_text(yaml.safe_dump({"tls_server_config": {"cert_file": str(crt),
                                                                            "key_file": str(key)}, **web}))
    logs = tmp_path / "logs"
    logs.mkdir()
    agent = TlsAgent(logs, tmp_path / "state", "--web.config.file", str(tmp_path / "web.yml"))
    agent.ctx = ssl.create_default_context(cafile=str(ca))
    return agent


def leave_early(agent: TlsAgent, reset: bool) -> None:
    """Ask for /metrics over TLS and vanish without reading it or a TLS goodbye (close_notify):
    a plain close, or a reset."""
    raw = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    tls = agent.ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    if reset:
        tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    tls.close()


def disconnects(agent: TlsAgent) -> float:
    code, body = agent.fetch("/metrics", agent.auth)
    assert code == 200
    for line in body.decode().splitlines():
        if line.startswith("precision_agent_http_client_disconnects_total "):
            return float(line.split()[1])
    raise AssertionError("precision_agent_http_client_disconnects_total not exported")


def test_tls_client_leaving_mid_response_is_counted_without_a_traceback(tmp_path: Path) -> None:
    agent = tls_agent(tmp_path, {})
    agent.auth = None
    agent.start()
    try:
        def gone() -> bool:
            for i in range(6):
                leave_early(agent, reset=i % 2 == 1)
            return disconnects(agent) >= 1
        wait_for(gone, 30, what="an early disconnect counted")
        err = agent.stderr()
        assert "Traceback" not in err and "SSLEOFError" not in err, err[-2000:]
        assert agent.fetch("/-/ready", None)[0] == 200  # the server goes on serving
    finally:
        agent.stop()


def test_wrong_password_flood_is_throttled_and_the_scraper_still_served(tmp_path: Path) -> None:
    agent = tls_agent(tmp_path, {"basic_auth_users": {"prom": bcrypt_hash("right")}})
    agent.auth = "prom:right"
    agent.start()  # its readiness checks verified (and cached) the scraper's credentials
    try:
        codes = [agent.fetch("/metrics", f"prom:wrong{i}")[0] for i in range(40)]  # distinct: no cache helps
        assert codes[:5] == [401] * 5  # the first failures are checked ...
        assert codes.count(429) >= 30   # ... then refused without a bcrypt check each
        assert agent.fetch("/metrics", "prom:wrong0")[0] in (401, 429)  # a repeated wrong one: cached or throttled
        t0 = time.monotonic()
        assert agent.fetch("/metrics", "prom:right")[0] == 200  # the cached scraper is not throttled
        assert time.monotonic() - t0 < 5  # (a bound for a hung server, not a timing claim)
        _, body = agent.fetch("/metrics", "prom:right")
        assert b"precision_agent_http_auth_failures_total 41.0" in body
    finally:
        agent.stop()
