"""Fuzz target of the HTTP listener: hostile requests against a running agent on 127.0.0.1.

Unlike the other targets this one needs the real daemon (its port and pid); the caller starts it
(tests: tests/support/agent.py, bench: bench/common.py). Each case opens one connection, sends a
generated request (bad methods, paths, versions, headers, bodies, line endings, pipelining), half-
closes and reads what comes back. A case fails when the agent dies, refuses connections, answers
something that is not HTTP/1.x, answers 500 (a handler raised), or when ``/-/ready`` stops
answering in time (checked every ``check_every`` cases and at the end).
"""

from __future__ import annotations

import random
import socket
import time
import urllib.request

from .core import Failure, Report, case_rng, preview
from .mutate import JUNK, pick

NAME = "http"
METHODS = ["GET", "GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "CONNECT", "PATCH", "get",
           "G\x00T", "GETT", "", " GET", "\x16\x03\x01", "PRI", "M" * 300]
PATHS = ["/metrics", "/api/v1/status", "/api/v1/alerts", "/-/ready", "/-/healthy", "/", "/api/v1/", "/api/v1/%00",
         "/metrics?name[]=x&%ff", "//metrics", "/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "*",
         "http://evil.example/metrics", "/metrics#frag", "/" + "a" * 5000, "/\u00e9\u202e", "", "/ /", "/%",
         "/api/v1/status?" + "x=1&" * 500, "/-/ready\r\nX: y"]
VERSIONS = ["HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.1.1", "HTTP/", "http/1.1", "",
            "HTTP/1." + "1" * 100, "HTTP/9999999999999999999.1"]
HEADERS = ["Host: 127.0.0.1", "Host:", "Host: " + "h" * 9000, "Content-Length: 5", "Content-Length: -1",
           "Content-Length: 99999999999999999999", "Content-Length: 1, 2", "Content-Length: abc",
           "Transfer-Encoding: chunked", "Transfer-Encoding: gzip, chunked", "Expect: 100-continue",
           "Connection: keep-alive", "Connection: close", "Connection: Upgrade", "Upgrade: h2c",
           "Authorization: Basic " + "A" * 40, "Authorization: Basic !!!", "Authorization: Bearer x",
           "Accept-Encoding: gzip", "Accept: application/openmetrics-text; version=1.0.0",
           "Accept: */*;q=NaN", " folded: continuation", "NoColon", ": empty-name", "X-" + "x" * 200 + ": y",
           "X-Null: a\x00b", "X-Latin: \xe9\xff", "Range: bytes=0-1,0-1,0-1", "Cookie: " + "c=1; " * 400]
BODIES = [b"", b"0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n", b"zz\r\n", b"x" * 70000, b"\x00" * 64,
          b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"]


def make_request(rng: random.Random) -> bytes:
    if rng.random() < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 600)))
    eol = rng.choice(("\r\n",) * 6 + ("\n", "\r", "\n\r", ""))
    line = " ".join(x for x in (pick(rng, METHODS), pick(rng, PATHS), pick(rng, VERSIONS)) if x or rng.random() < 0.5)
    if rng.random() < 0.1:
        line = line.replace(" ", rng.choice(("  ", "\t", "")))
    headers = [pick(rng, HEADERS) for _ in range(rng.choice((0, 1, 2, 4, 12)))]
    if rng.random() < 0.05:
        headers += [f"X-{i}: {i}" for i in range(rng.choice((100, 2000)))]
    if rng.random() < 0.1:
        headers.append(pick(rng, JUNK) * rng.randint(1, 50))
    head = eol.join([line, *headers]) + eol + (eol if rng.random() < 0.9 else "")
    body = pick(rng, BODIES) if rng.random() < 0.3 else b""
    raw = head.encode("utf-8", "surrogatepass") + body
    if rng.random() < 0.1:  # pipelined: a second request behind the first
        raw += b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n"
    if rng.random() < 0.1:
        raw = raw[:rng.randint(0, len(raw))]
    return raw


def send(port: int, raw: bytes, timeout: float = 3.0) -> bytes:
    """Send ``raw`` on a fresh connection, half-close, return the first bytes of the answer
    (b"" when the server closed without one or stayed silent for ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed first (e.g. a 431 after too many header bytes)
            pass
        got = b""
        try:
            while len(got) < 4096:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return got


def ready(port: int, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def run_http(port: int, pid: int, seed: int, count: int, *, start: int = 0, check_every: int = 50) -> Report:
    rep = Report(NAME, seed)
    t_begin = time.monotonic()
    hwm0 = rss_kb(pid)
    for i in range(start, start + count):
        raw = make_request(case_rng(seed, NAME, i))
        t0 = time.perf_counter()
        fail = None
        try:
            got = send(port, raw)
            first = got.split(b"\r\n", 1)[0]
            if got and not (first.startswith(b"HTTP/1.") and first[9:12].isdigit()):
                fail = ("exception", f"not an HTTP/1.x answer: {first[:80]!r}")
            elif first[9:12] == b"500":
                fail = ("exception", "500: a handler raised")
        except OSError as exc:
            fail = ("crash", f"connection failed: {exc!r}")
        dt = time.perf_counter() - t0
        rep.cases += 1
        if dt > rep.slowest_s:
            rep.slowest_s, rep.slowest_index = dt, i
        if fail is None and not alive(pid):
            fail = ("crash", "the agent exited")
        if fail is None and ((i - start + 1) % check_every == 0 or i == start + count - 1) and not ready(port):
            fail = ("hang", "/-/ready did not answer 200 within 5 s")
        if fail is not None:
            rep.failures.append(Failure(NAME, seed, i, fail[0], fail[1], preview(raw)))
            if not alive(pid):
                break
    rep.rss_growth_mb = max(rss_kb(pid) - hwm0, 0) / 1024 if alive(pid) else 0.0
    rep.seconds = time.monotonic() - t_begin
    return rep
