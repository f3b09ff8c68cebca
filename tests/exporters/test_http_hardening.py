"""The HTTP listener under hostile clients, and TLS + basic auth from an exporter-toolkit web
config file: the real daemon as a subprocess, raw sockets and real TLS clients."""

from __future__ import annotations

import base64
import os
import select
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from support.agent import AgentProcess
from conftest import free_port, wait_for
from support.agent import TlsAgent, bcrypt_hash, make_certs


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{key} not in /proc/{pid}/status")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start(tmp_path: Path, config: dict, *extra: str, port: int | None = None) -> AgentProcess:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump(config))
    return AgentProcess(logs, tmp_path / "state", "--config", str(cfg), *extra, port=port).start()


def half_open(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metr")  # half a request line, then silence
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket, timeout: float) -> bytes | None:
    """What the server said before closing ``s``, or None if it is still open after ``timeout``."""
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except socket.timeout:
        return None
    except ConnectionResetError:
        pass
    return data


def closed_by_server_among(socks: list[socket.socket], want: int, timeout: float) -> list[bytes]:
    """What the server said before closing each socket of ``socks`` it closes, watched all at
    once until ``want`` of them are closed or ``timeout`` has passed."""
    said: dict[socket.socket, bytes] = {}
    got = {s: b"" for s in socks}
    deadline = time.monotonic() + timeout
    while len(said) < want and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([s for s in socks if s not in said], [], [], left)
        for s in ready:
            try:
                chunk = s.recv(4096)
            except ConnectionResetError:
                chunk = b""
            if chunk:
                got[s] += chunk
            else:
                said[s] = got[s]
    return list(said.values())


def test_half_open_connections_hold_no_threads_and_time_out(tmp_path: Path) -> None:
    agent = start(tmp_path, {"http": {"header_timeout": "3s", "idle_timeout": "3s"}})
    socks: list[socket.socket] = []
    try:
        pid = agent.proc.pid
        threads, fds = proc_status(pid, "Threads"), open_fds(pid)
        socks = half_open(agent.port, 300)

        def all_accepted() -> bool:
            # open now, or accepted and already timed out: on a loaded host the first ones may
            # reach header_timeout before the last is accepted, so the 300 need not be open at once.
            # Counted by the agent itself (the open gauge includes this scrape's own connection):
            # a baseline of fds taken during start-up may hold files the agent closes later.
            # One scrape; a connection between its timeout count and its close may still count
            # twice, which only ends this wait a moment early: what follows checks every one
            values = {}
            for line in agent.get("/metrics").splitlines():
                if line.startswith(("precision_agent_http_connections_open ",
                                    'precision_agent_http_connections_refused_total{reason="timeout"} ')):
                    name, _, value = line.rpartition(" ")
                    values[name] = float(value)
            open_ = values.get("precision_agent_http_connections_open", 0.0)
            timed_out = values.get('precision_agent_http_connections_refused_total{reason="timeout"}', 0.0)
            return open_ - 1 + timed_out >= 300
        wait_for(all_accepted, 30, what="the agent to accept the 300 connections")
        assert proc_status(pid, "Threads") <= threads + 2, "half-open connections must not hold threads"
        # a normal client is served while the 300 wait
        assert "precision_agent_http_connections_open" in agent.get("/metrics")
        assert proc_status(pid, "Threads") <= threads + 2
        # past header_timeout, the server closes them (with a 408)
        said = [closed_by_server(s, 15) for s in socks]
        assert all(x is not None for x in said), "half-open sockets must be closed by the server"
        assert all(x == b"" or x.startswith(b"HTTP/1.1 408") for x in said)
        assert sum(x.startswith(b"HTTP/1.1 408") for x in said) >= 290
        assert agent.metric("precision_agent_http_connections_refused_total", reason="timeout") >= 300
        wait_for(lambda: open_fds(pid) <= fds + 5, 10, what="the agent to release the sockets")
    finally:
        for s in socks:
            s.close()
        agent.stop()


def test_connections_beyond_the_cap_are_refused_at_once_and_counted(tmp_path: Path) -> None:
    agent = start(tmp_path, {"http": {"max_connections": 20, "header_timeout": "60s", "idle_timeout": "60s"}})
    socks: list[socket.socket] = []
    try:
        socks = half_open(agent.port, 40)
        # the 20 held ones stay open for header_timeout (60 s): the others must be closed within
        # seconds, all watched at once (not half a second per held socket in turn)
        refused = closed_by_server_among(socks, 20, 5.0)
        assert len(refused) >= 20, "connections beyond max_connections must be closed at once"
        assert all(x == b"" or x.startswith(b"HTTP/1.1 503") for x in refused)
        for s in socks:
            s.close()  # the held ones go; their slots come back once the server has read their ends
        socks = []

        def refusals() -> float | None:
            try:
                return agent.metric("precision_agent_http_connections_refused_total", reason="limit")
            except urllib.error.HTTPError as exc:
                if exc.code == 503:   # still full: the closes not read yet
                    return None
                raise
        n = wait_for(refusals, 10, what="a slot back and the refusals counted")
        assert n >= 20
    finally:
        for s in socks:
            s.close()
        agent.stop()


def test_oversized_headers_are_refused(tmp_path: Path) -> None:
    agent = start(tmp_path, {"http": {"max_header_bytes": "4KiB"}})
    try:
        with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * 8000 + b"\r\n\r\n")
            assert (closed_by_server(s, 5) or b"").startswith(b"HTTP/1.1 431")
        assert agent.metric("precision_agent_http_connections_refused_total", reason="too_large") == 1
        assert agent.metric("precision_agent_ready") == 1  # normal requests still served
    finally:
        agent.stop()


# -- TLS and basic auth (exporter-toolkit web config) -----------------------------------------------


def test_tls_and_basic_auth_from_a_web_config_file(tmp_path: Path) -> None:
    ca, crt, key = make_certs(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": crt.name, "key_file": str(key),
                                                         "min_version": "TLS12"},
                                   "basic_auth_users": {"alice": bcrypt_hash("s3cret")},
                                   "http_server_config": {"headers": {"X-Frame-Options": "deny"}}}))
    logs = tmp_path / "logs"
    logs.mkdir()
    agent = TlsAgent(logs, tmp_path / "state", "--web.config.file", str(web))
    agent.ctx = ssl.create_default_context(cafile=str(ca))
    agent.auth = "alice:s3cret"
    agent.start()
    try:
        code, body = agent.fetch("/metrics", "alice:s3cret")
        assert code == 200 and b"precision_agent_ready 1.0" in body
        assert agent.fetch("/metrics", "alice:s3cret")[0] == 200  # the cached verification
        assert agent.fetch("/metrics", "alice:wrong")[0] == 401
        assert agent.fetch("/metrics", "mallory:s3cret")[0] == 401
        assert agent.fetch("/api/v1/status", None)[0] == 401
        with pytest.raises((urllib.error.URLError, OSError, ConnectionError)):
            agent.fetch("/metrics", "alice:s3cret", scheme="http")  # plain HTTP on the TLS port
        with pytest.raises((ssl.SSLError, urllib.error.URLError)):  # a client that does not trust the CA
            urllib.request.urlopen(f"https://127.0.0.1:{agent.port}/metrics", timeout=5,
                                   context=ssl.create_default_context())
        req = urllib.request.Request(f"https://127.0.0.1:{agent.port}/-/healthy")
        req.add_header("Authorization", "Basic " + base64.b64encode(b"alice:s3cret").decode())
        with urllib.request.urlopen(req, timeout=5, context=agent.ctx) as r:
            assert r.headers["X-Frame-Options"] == "deny"
        _, body = agent.fetch("/metrics", "alice:s3cret")
        assert b"precision_agent_http_auth_failures_total 3.0" in body
        assert b"precision_agent_http_insecure 0.0" in body
        # SIGHUP reads the web config file again: other users (or rotated certificates) apply at once
        web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": str(crt), "key_file": str(key)},
                                       "basic_auth_users": {"bob": bcrypt_hash("n3w")}}))
        agent.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: agent.fetch("/metrics", "bob:n3w")[0] == 200, 15, what="the new user after SIGHUP")
        assert agent.fetch("/metrics", "alice:s3cret")[0] == 401
        web.write_text("basic_auth_users: [broken\n")  # a broken file keeps the one in force
        agent.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "keeping the one in force" in agent.stderr(), 15, what="the broken file reported")
        assert agent.fetch("/metrics", "bob:n3w")[0] == 200
    finally:
        agent.stop()


def test_mutual_tls_with_allowed_sans(tmp_path: Path) -> None:
    ca, crt, key = make_certs(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {
        "cert_file": str(crt), "key_file": str(key), "client_auth_type": "RequireAndVerifyClientCert",
        "client_ca_file": str(ca), "client_allowed_sans": ["scraper"], "min_version": "TLS13"}}))
    logs = tmp_path / "logs"
    logs.mkdir()

    def client(name: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(ca))
        if name:
            ctx.load_cert_chain(tmp_path / f"{name}.crt", tmp_path / f"{name}.key")
        return ctx
    agent = TlsAgent(logs, tmp_path / "state", "--web.config.file", str(web))
    agent.ctx, agent.auth = client("scraper"), None
    agent.start()
    try:
        code, body = agent.fetch("/metrics", None)
        assert code == 200 and b"precision_agent_http_insecure 0.0" in body
        for name in (None, "intruder"):  # no certificate; a certificate of the CA with another SAN
            agent.ctx = client(name)
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                agent.fetch("/metrics", None)
        agent.ctx = client("scraper")
        _, body = agent.fetch("/metrics", None)
        assert b'precision_agent_http_connections_refused_total{reason="client_cert"} 1.0' in body
    finally:
        agent.stop()


@pytest.mark.parametrize("web, field", [
    ({"tls_server_config": {"cert_file": "missing.crt", "key_file": "missing.key"}}, "tls_server_config.cert_file"),
    ({"basic_auth_users": {"alice": "plaintext"}}, "basic_auth_users.alice"),
    ({"tls_server_config": {"cert_file": "x", "key_file": "y"}, "bogus": 1}, "bogus"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key", "min_version": "TLS14"}},
     "tls_server_config.min_version"),
])
def test_bad_web_config_exits_2_naming_the_problem(tmp_path: Path, web: dict, field: str) -> None:
    if "server.crt" in str(web):
        make_certs(tmp_path)
    (tmp_path / "logs").mkdir()
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump(web))
    r = subprocess.run([sys.executable, "-m", "precision_agent", "run", "--watch", str(tmp_path / "logs"),
                        "--state", str(tmp_path / "state"), "--listen", f"127.0.0.1:{free_port()}",
                        "--web.config.file", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert str(path) in r.stderr and field in r.stderr


def test_listener_beyond_loopback_without_tls_and_auth_warns(tmp_path: Path) -> None:
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    agent = AgentProcess(logs, tmp_path / "state", port=port)
    agent.args[agent.args.index("--listen") + 1] = f"0.0.0.0:{port}"
    agent.start()
    try:
        assert agent.metric("precision_agent_http_insecure") == 1
        assert "without TLS and authentication" in agent.stderr()
    finally:
        agent.stop()
    loop = AgentProcess(logs, tmp_path / "state2").start()
    try:
        assert loop.metric("precision_agent_http_insecure") == 0
    finally:
        loop.stop()
