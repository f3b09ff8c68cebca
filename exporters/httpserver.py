"""A small HTTP/1.x server that a hostile network cannot exhaust.

One I/O thread accepts connections and reads each request's line and headers without blocking
(a ``selectors`` loop, TLS handshakes included); only a request whose headers arrived complete
goes to one of a fixed pool of worker threads, which runs the WSGI app (stdlib ``wsgiref``) and
writes the response under a write timeout. So:

* threads are bounded (1 + ``workers``), whatever the clients do: a half-open connection costs a
  file descriptor and a few bytes, not a thread;
* open connections are capped (``max_connections``): beyond, a new one is closed at once (with a
  ``503`` where it is plain HTTP) and counted;
* a request's line and headers must arrive within ``header_timeout`` of the connection, with no
  silence longer than ``idle_timeout``; past either, the server answers ``408`` and closes;
* they may not exceed ``max_header_bytes`` (``431``). Bodies are not expected: the endpoints are
  read-only, and one connection serves one request.
"""

from __future__ import annotations

import io
import logging
import queue
import resource
import selectors
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler

log = logging.getLogger(__name__)

REFUSE_REASONS = ("limit", "timeout", "too_large", "tls", "client_cert")
PeerCheck = Callable[[dict[str, Any] | None], str | None]  # peer cert -> reason to refuse, or None


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_connections: int = 512       # open connections, waiting or being served
    workers: int = 4                 # threads running the app (requests served in parallel)
    header_timeout: float = 10.0     # request line + headers must arrive within this
    idle_timeout: float = 5.0        # longest silence while they arrive
    write_timeout: float = 10.0      # a response must be written within this
    max_header_bytes: int = 16384    # request line + headers


@dataclass
class HttpStats:
    """Counters the collector exports; updated by the I/O thread and the workers."""

    open: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSE_REASONS, 0))
    client_gone: int = 0  # responses cut short by the client (closed or reset mid-response)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> tuple[int, dict[str, int]]:
        with self.lock:
            return self.open, dict(self.refused)

    def gone(self) -> None:
        with self.lock:
            self.client_gone += 1


class _Conn:
    __slots__ = ("sock", "addr", "start", "last", "buf", "handshaking", "events")

    def __init__(self, sock: socket.socket, addr: Any, now: float, tls: bool) -> None:
        self.sock, self.addr = sock, addr
        self.start = self.last = now
        self.buf = bytearray()
        self.handshaking = tls
        self.events = selectors.EVENT_READ


class _Writer(io.RawIOBase):
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._sock.sendall(b)
        return len(b)


# a client that went away while its response was written: TLS says so with SSLEOFError (or
# another SSLError), plain TCP with a reset or a broken pipe; wsgiref prints a traceback for
# all but the last two. Counted and logged at debug: a scraper that gives up is no agent error.
_CLIENT_GONE = (ssl.SSLError, ConnectionError, TimeoutError)


class _ServerHandler(ServerHandler):
    request_handler: "_Handler"

    def finish_response(self) -> None:
        try:
            super().finish_response()
        except _CLIENT_GONE as exc:  # wsgiref would swallow a reset silently and print a TLS EOF
            self._gone(exc)

    def handle_error(self) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, _CLIENT_GONE):  # no traceback, and no 500 page to a client that is gone
            self._gone(exc)
            self.close()
            return
        super().handle_error()

    def _gone(self, exc: BaseException) -> None:
        self.request_handler.server.stats.gone()
        log.debug("http: client %s went away during the response: %r", self.request_handler.client_address, exc)


class _Handler(WSGIRequestHandler):
    """wsgiref's request handler over headers the I/O thread already read."""

    # A request line without a version is HTTP/0.9 to the stdlib, which then answers with a bare
    # body: no status line, no headers (found by the fuzz suite). Nothing scrapes that way; such
    # a request is answered as HTTP/1.0, with a status line (400 for anything but GET).
    default_request_version = "HTTP/1.0"

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.request_version == "HTTP/0.9":  # said explicitly: refused, with a status line
            self.request_version = "HTTP/1.0"
            self.close_connection = True
            self.send_error(505, "HTTP/0.9 is not supported")
            return False
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        if self.request_version == "HTTP/0.9":  # the stdlib set it from a line it then refused
            self.request_version = "HTTP/1.0"
        super().send_error(code, message, explain)

    def __init__(self, sock: socket.socket, addr: Any, server: "HttpServer", head: bytes) -> None:
        self._head = head
        super().__init__(sock, addr, server)  # type: ignore[arg-type] - duck-typed server

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = io.BytesIO(self._head)
        self.wfile = _Writer(self.connection)

    def finish(self) -> None:
        self.rfile.close()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("http: " + format, *args)

    def handle(self) -> None:
        """The stdlib's, with a ServerHandler that counts a client gone instead of a traceback."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():
            return
        handler = _ServerHandler(self.rfile, self.wfile, self.get_stderr(), self.get_environ(), multithread=False)
        handler.request_handler = self
        handler.run(self.server.get_app())  # type: ignore[attr-defined]


def _reply(sock: socket.socket, status: str) -> None:
    """A last word on a connection about to close (plain HTTP only; never blocks)."""
    try:
        sock.send(f"HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n".encode())
    except OSError:
        pass


def _fd_room(connections: int) -> None:
    """Raise the soft limit on open files (1024 under systemd's default) towards the hard one, so
    ``max_connections`` half-open sockets cannot starve the agent's own files (as Go does)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = max(4096, connections + 1024)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                                        hard))
    except (OSError, ValueError):
        pass


class HttpServer:
    """``app``: a WSGI app. ``tls``: a server-side SSLContext, or None for plain HTTP;
    ``peer_check`` refuses a TLS client by its certificate (``client_allowed_sans``)."""

    def __init__(self, host: str, port: int, app: Callable, limits: ServerLimits | None = None,
                 tls: ssl.SSLContext | None = None, peer_check: PeerCheck | None = None) -> None:
        self.app, self.limits, self.tls, self.peer_check = app, limits or ServerLimits(), tls, peer_check
        self.stats = HttpStats()
        _fd_room(self.limits.max_connections)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self.server_name = socket.getfqdn(host) if host else "localhost"
        self.server_port = self.server_address[1]
        self.base_environ = {"SERVER_NAME": self.server_name, "GATEWAY_INTERFACE": "CGI/1.1",
                             "SERVER_PORT": str(self.server_port), "REMOTE_HOST": "", "CONTENT_LENGTH": "",
                             "SCRIPT_NAME": ""}
        if tls is not None:
            self.base_environ["HTTPS"] = "on"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._conns: set[_Conn] = set()
        self._jobs: queue.Queue[_Conn | None] = queue.Queue()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name="http-io", daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"http-{i}", daemon=True)
                          for i in range(self.limits.workers)]
        self._last_refusal_log = 0.0

    # -- WSGIServer's duck type, as wsgiref's handler uses it ------------------------------------
    def get_app(self) -> Callable:
        return self.app

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stopping.set()
        for _ in range(self.limits.workers):
            self._jobs.put(None)
        deadline = time.monotonic() + min(self.limits.write_timeout, 5.0) + 1  # daemon threads: never hold the exit
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=max(deadline - time.monotonic(), 0.0))
        for conn in list(self._conns):
            self._close(conn)
        self._sel.close()
        self._listener.close()

    # -- the I/O thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            now = time.monotonic()
            wait = 0.5
            for conn in self._conns:
                wait = min(wait, self._deadline(conn) - now)
            for key, _mask in self._sel.select(max(wait, 0.0)):
                if key.data is None:
                    self._accept()
                else:
                    self._step(key.data)
            now = time.monotonic()
            for conn in [c for c in self._conns if self._deadline(c) <= now]:
                if not conn.handshaking and self.tls is None:
                    _reply(conn.sock, "408 Request Timeout")
                self._refuse("timeout", conn)

    def _deadline(self, conn: _Conn) -> float:
        return min(conn.start + self.limits.header_timeout, conn.last + self.limits.idle_timeout)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: the connections stay in the backlog meanwhile
                self._log_refusal(f"cannot accept connections: {exc}")
                return
            with self.stats.lock:
                full = self.stats.open >= self.limits.max_connections
                if not full:
                    self.stats.open += 1
            if full:
                if self.tls is None:
                    _reply(sock, "503 Service Unavailable")
                sock.close()
                self._count("limit")
                self._log_refusal(f"refusing connections beyond http.max_connections="
                                  f"{self.limits.max_connections}")
                continue
            sock.setblocking(False)
            if self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError):
                    sock.close()
                    self._release()
                    self._count("tls")
                    continue
            conn = _Conn(sock, addr, time.monotonic(), self.tls is not None)
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _step(self, conn: _Conn) -> None:
        try:
            if conn.handshaking:
                conn.sock.do_handshake()  # type: ignore[attr-defined]
                conn.handshaking = False
                conn.last = time.monotonic()
                if self.peer_check is not None:
                    why = self.peer_check(conn.sock.getpeercert())  # type: ignore[attr-defined]
                    if why is not None:
                        log.debug("http: refusing TLS client %s: %s", conn.addr, why)
                        self._refuse("client_cert", conn)
                        return
            while True:
                data = conn.sock.recv(4096)
                if not data:  # the client gave up
                    self._close(conn)
                    return
                conn.buf += data
                conn.last = time.monotonic()
                end = _header_end(conn.buf)
                if (end if end >= 0 else len(conn.buf)) > self.limits.max_header_bytes:
                    if self.tls is None:
                        _reply(conn.sock, "431 Request Header Fields Too Large")
                    self._refuse("too_large", conn)
                    return
                if end >= 0:
                    self._hand_off(conn)
                    return
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
        except (BlockingIOError, InterruptedError):
            pass
        except (ssl.SSLError, OSError, ValueError) as exc:
            log.debug("http: connection from %s failed: %s", conn.addr, exc)
            if conn.handshaking:
                self._refuse("tls", conn)
            else:
                self._close(conn)

    def _want(self, conn: _Conn, events: int) -> None:
        if conn.events != events:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)

    def _hand_off(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        self._conns.discard(conn)
        try:
            conn.sock.settimeout(self.limits.write_timeout)
        except OSError:
            self._drop(conn)
            return
        self._jobs.put(conn)

    # -- workers ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            conn = self._jobs.get()
            if conn is None:
                return
            try:
                _Handler(conn.sock, conn.addr, self, bytes(conn.buf))
            except _CLIENT_GONE as exc:  # gone before wsgiref ran the app (or after it)
                self.stats.gone()
                log.debug("http: client %s went away: %r", conn.addr, exc)
            except Exception as exc:  # a client too slow: its connection only
                log.debug("http: request from %s failed: %s", conn.addr, exc)
            finally:
                self._drop(conn)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _refuse(self, reason: str, conn: _Conn) -> None:
        self._count(reason)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self._conns.discard(conn)
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        try:
            conn.sock.close()
        except OSError:
            pass
        self._release()

    def _release(self) -> None:
        with self.stats.lock:
            self.stats.open -= 1

    def _count(self, reason: str) -> None:
        with self.stats.lock:
            self.stats.refused[reason] += 1

    def _log_refusal(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_refusal_log >= 60:  # a flood of connections must not flood the log
            self._last_refusal_log = now
            log.warning("http: %s (see precision_agent_http_connections_refused_total)", message)


def _header_end(buf: bytearray) -> int:
    """Where the blank line after the headers ends, or -1."""
    i = buf.find(b"\r\n\r\n")
    if i >= 0:
        return i + 4
    i = buf.find(b"\n\n")
    return i + 2 if i >= 0 else -1
