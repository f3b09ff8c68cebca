"""The agent's HTTP endpoint: ``/metrics``, ``/api/v1/alerts``, ``/api/v1/status``,
``/api/v1/compare`` (the last dump comparisons, full tables), health checks.

One small server (``httpserver.py``: bounded threads, connection cap, header timeouts) serves
everything, bound to 127.0.0.1 unless the operator says otherwise; TLS, basic auth, extra
response headers and a rate limit come from an exporter-toolkit web config file
(``webconfig.py``). It only reads snapshots; it never blocks the pipeline for long.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..model import json_safe
from . import exposition
from .httpserver import HttpServer, ServerLimits
from .webconfig import BasicAuth, RateLimit, WebConfig, is_loopback

log = logging.getLogger(__name__)

StatusFn = Callable[[], dict[str, Any]]
AlertsFn = Callable[[], "dict[str, Any] | bytes"]  # bytes: the finished body (api.AlertsView)


def json_bytes(doc: Any) -> bytes:
    """The API's JSON encoding: compact, no NaN/Inf (``json_safe`` made them strings)."""
    return json.dumps(doc, default=str, allow_nan=False, separators=(",", ":")).encode()


def _json(start_response, body: Any, status: str = "200 OK") -> list[bytes]:
    data = body if isinstance(body, bytes) else json_bytes(body)
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]


def _guarded(app: Callable, web: WebConfig | None, on_auth_failure: Callable[[], None]) -> Callable:
    """The web config's rate limit, basic auth and response headers around ``app``."""
    if web is None:
        return app
    auth = BasicAuth(web.users) if web.users else None
    rate = RateLimit(web.rate_interval, web.rate_burst) if web.rate_interval > 0 else None
    extra = list(web.headers)

    def guarded(environ: dict[str, Any], start_response) -> Iterable[bytes]:
        def respond(status: str, headers: list, exc_info: Any = None):
            return start_response(status, headers + extra, exc_info) if exc_info else \
                start_response(status, headers + extra)
        if rate is not None and not rate.allow():
            return _json(respond, {"status": "error", "error": "too many requests"}, "429 Too Many Requests")
        verdict = "ok" if auth is None else auth.verify(environ.get("HTTP_AUTHORIZATION"),
                                                        environ.get("REMOTE_ADDR", ""))
        if verdict == "throttled":  # failed attempts come too fast: refused without a bcrypt check
            on_auth_failure()
            return _json(lambda st, hd: respond(st, hd + [("Retry-After", "2")]),
                         {"status": "error", "error": "too many failed authentication attempts"},
                         "429 Too Many Requests")
        if verdict != "ok":
            on_auth_failure()
            body = b"Unauthorized\n"
            respond("401 Unauthorized", [("Content-Type", "text/plain"), ("Content-Length", str(len(body))),
                                         ("WWW-Authenticate", 'Basic realm="precision-agent"')])
            return [body]
        return app(environ, respond)
    return guarded


class HttpExporter:
    def __init__(self, host: str, port: int, registry: CollectorRegistry, alerts: AlertsFn,
                 status: StatusFn, ready: Callable[[], bool], routes: dict[str, StatusFn] | None = None,
                 limits: ServerLimits | None = None, web: WebConfig | None = None) -> None:
        metrics_app = exposition.metrics_app(registry)
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
                    doc = alerts()
                    return _json(start_response, doc if isinstance(doc, bytes) else
                                 {"status": "success", "data": json_safe(doc)})
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

        self._app = app
        self.web = web
        self.auth_failures = 0
        self._lock = threading.Lock()
        self.server = HttpServer(host, port, _guarded(app, web, self._auth_failed), limits,
                                 web.tls if web else None, web.peer_check if web and web.allowed_sans else None)
        self.host, self.port = host, self.server.server_address[1]
        self.insecure = self._insecure_reason()

    def apply(self, web: WebConfig | None) -> None:
        """A web config file read again (SIGHUP): new certificates, users, headers take effect for
        the next connections. Turning TLS on or off takes a restart (ValueError)."""
        if (web is not None and web.tls is not None) != (self.web is not None and self.web.tls is not None):
            raise ValueError("turning TLS on or off takes a restart")
        self.server.app = _guarded(self._app, web, self._auth_failed)
        self.server.peer_check = web.peer_check if web and web.allowed_sans else None
        self.server.tls = web.tls if web else None
        self.web = web
        self.insecure = self._insecure_reason()

    def _auth_failed(self) -> None:
        with self._lock:
            self.auth_failures += 1

    def _insecure_reason(self) -> str | None:
        """Why this listener is open to whoever reaches it, or None (loopback, or TLS + auth)."""
        if is_loopback([self.server.server_address[0]]):
            return None
        web = self.web
        tls = web is not None and web.tls is not None
        authed = web is not None and (bool(web.users) or web.client_verified)
        if tls and authed:
            return None
        missing = " and ".join(w for w, ok in (("TLS", tls), ("authentication", authed)) if not ok)
        return f"listening on {self.host} (not loopback) without {missing}"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.web is not None and self.web.tls is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    def start(self) -> None:
        if self.insecure:
            log.warning("%s: anyone who can reach this port can read the agent's metrics and status; "
                        "set web_config_file (TLS and basic_auth_users, the exporter-toolkit format) or listen "
                        "on 127.0.0.1", self.insecure)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


class HttpCollector(Collector):
    """The HTTP server's own metrics."""

    def __init__(self, http: HttpExporter) -> None:
        self.http = http

    def collect(self) -> Iterator[Metric]:
        open_, refused = self.http.server.stats.snapshot()
        g = GaugeMetricFamily("precision_agent_http_connections_open", "HTTP connections open (waiting or served).")
        g.add_metric([], open_)
        yield g
        c = CounterMetricFamily("precision_agent_http_connections_refused",
                                "HTTP connections closed by the agent before a response: limit (beyond "
                                "http.max_connections), timeout (headers too slow), too_large (headers over "
                                "http.max_header_bytes), tls (handshake failed), client_cert (not in "
                                "client_allowed_sans).", labels=["reason"])
        for reason, n in refused.items():
            c.add_metric([reason], n)
        yield c
        c = CounterMetricFamily("precision_agent_http_client_disconnects", "HTTP responses cut short because "
                                "the client closed or reset the connection (TLS: SSLEOFError); logged at debug.")
        c.add_metric([], self.http.server.stats.client_gone)
        yield c
        c = CounterMetricFamily("precision_agent_http_auth_failures", "HTTP requests refused with 401 "
                                "(basic auth of the web config file).")
        c.add_metric([], self.http.auth_failures)
        yield c
        g = GaugeMetricFamily("precision_agent_http_insecure", "1 when the HTTP listener is reachable beyond "
                              "loopback without TLS and authentication (web_config_file).")
        g.add_metric([], 1.0 if self.http.insecure else 0.0)
        yield g
