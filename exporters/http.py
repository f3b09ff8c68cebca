"""The agent's HTTP endpoint: ``/metrics``, ``/api/v1/alerts``, ``/api/v1/status``,
``/api/v1/compare`` (the last dump comparisons, full tables), health checks.

One small threaded WSGI server (stdlib ``wsgiref``) serves everything, bound to 127.0.0.1 unless
the operator says otherwise. It only reads snapshots; it never blocks the pipeline for long.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from ..model import json_safe

log = logging.getLogger(__name__)

StatusFn = Callable[[], dict[str, Any]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("http: " + format, *args)


def _json(start_response, body: Any, status: str = "200 OK") -> list[bytes]:
    data = json.dumps(body, default=str, allow_nan=False, separators=(",", ":")).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]


class HttpExporter:
    def __init__(self, host: str, port: int, registry: CollectorRegistry, alerts: StatusFn,
                 status: StatusFn, ready: Callable[[], bool], routes: dict[str, StatusFn] | None = None) -> None:
        metrics_app = make_wsgi_app(registry)
        routes = dict(routes or {})

        def app(environ: dict[str, Any], start_response) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "/")
            if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
                return _json(start_response, {"status": "error", "error": "method not allowed"},
                             "405 Method Not Allowed")
            try:
                if path == "/metrics":
                    return metrics_app(environ, start_response)
                if path == "/api/v1/alerts":
                    return _json(start_response, {"status": "success", "data": json_safe(alerts())})
                if path == "/api/v1/status":
                    return _json(start_response, {"status": "success", "data": json_safe(status())})
                if path in routes:
                    return _json(start_response, {"status": "success", "data": json_safe(routes[path]())})
                if path == "/-/healthy":
                    return _json(start_response, {"status": "healthy"})
                if path == "/-/ready":
                    ok = ready()
                    return _json(start_response, {"status": "ready" if ok else "starting"},
                                 "200 OK" if ok else "503 Service Unavailable")
                if path == "/":
                    body = (b"<html><body><h1>precision-agent</h1><ul><li><a href='/metrics'>/metrics</a></li>"
                            b"<li><a href='/api/v1/alerts'>/api/v1/alerts</a></li>"
                            b"<li><a href='/api/v1/status'>/api/v1/status</a></li>"
                            b"<li><a href='/api/v1/compare'>/api/v1/compare</a></li></ul></body></html>")
                    start_response("200 OK", [("Content-Type", "text/html"), ("Content-Length", str(len(body)))])
                    return [body]
                return _json(start_response, {"status": "error", "error": "not found"}, "404 Not Found")
            except Exception as exc:  # a bug in a handler must not kill the server thread
                log.exception("http handler failed for %s", path)
                return _json(start_response, {"status": "error", "error": str(exc)}, "500 Internal Server Error")

        server_class = _Server6 if ":" in host else _Server
        self.server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
        self.host, self.port = host, self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
