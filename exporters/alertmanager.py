"""Push the agent's alerts to Alertmanager (API v2), the way Prometheus' notifier does.

Prometheus-side rules can page only while Prometheus scrapes the agent; pushing directly lets the
agent page on its own. Semantics follow Prometheus so that Alertmanager treats us like any other
alert source:

- a firing alert is sent at once, then re-sent every ``resend_interval`` with ``endsAt`` set
  ``lifetime`` (default 4 x the interval) ahead: an agent that dies stops re-sending and its
  alerts expire in Alertmanager instead of staying active forever;
- a resolved alert is sent with ``endsAt`` = its resolve time, and repeated with the resends for
  15 minutes so a resolve that met an unreachable Alertmanager still arrives;
- pending alerts are never sent.

``sync()`` runs on the agent's worker thread after each batch: it only diffs states and hands
payloads to one sender thread per Alertmanager URL through a bounded per-URL queue (one payload
per alert, newest wins). A slow or dead Alertmanager therefore delays nothing but its own queue;
failed requests are retried with exponential backoff, counted and logged. stdlib only (urllib).
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from datetime import datetime, timezone
from itertools import islice
from http.client import HTTPException
from typing import Any, Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import __version__
from ..model import Alert, AlertState

log = logging.getLogger(__name__)

MAX_BATCH = 64             # alerts per POST, as Prometheus' notifier
API_PATH = "/api/v2/alerts"
RESOLVED_RESEND_S = 900.0  # resolved alerts ride along with the resends this long (Prometheus: 15m)


from ..config.alertmanager import AlertmanagerConfig


def rfc3339(t: float) -> str:
    """Alertmanager's time format (UTC, millisecond precision)."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = self.failed = self.dropped = 0

    def add(self, sent: int = 0, failed: int = 0, dropped: int = 0) -> None:
        with self.lock:
            self.sent += sent
            self.failed += failed
            self.dropped += dropped


class _Target:
    """One Alertmanager: its bounded queue (fingerprint -> newest payload) and sender thread."""

    def __init__(self, url: str, pusher: "AlertmanagerPusher") -> None:
        self.url = url.rstrip("/") + API_PATH
        self.pusher = pusher
        self.pending: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.cond = threading.Condition()
        self.stopping = False
        self.healthy = True
        self.thread = threading.Thread(target=self._run, name=f"alertmanager {url}", daemon=True)

    def put(self, payloads: Iterable[tuple[str, dict[str, Any]]]) -> None:
        dropped = 0
        with self.cond:
            for fp, payload in payloads:
                self.pending.pop(fp, None)
                self.pending[fp] = payload
                if len(self.pending) > self.pusher.config.queue_size:
                    self.pending.popitem(last=False)
                    dropped += 1
            self.cond.notify()
        if dropped:
            self.pusher._stats.add(dropped=dropped)
            self.pusher._report(f"alertmanager queue for {self.url} full: dropped {dropped} alert(s)")

    def _run(self) -> None:
        cfg = self.pusher.config
        backoff, next_try = cfg.retry_backoff, 0.0
        while True:
            with self.cond:
                while not self.stopping and (not self.pending or time.monotonic() < next_try):
                    self.cond.wait(max(0.0, next_try - time.monotonic()) if self.pending else None)
                if self.stopping and not (self.pending and self.healthy):
                    return  # a final flush only where the last attempt worked: never hang a shutdown
                batch = list(islice(self.pending.items(), MAX_BATCH))
            ok, retry = self.pusher._post(self.url, [p for _, p in batch])
            self.pusher._stats.add(sent=len(batch) if ok else 0, failed=0 if ok else 1,
                                   dropped=len(batch) if not ok and not retry else 0)
            with self.cond:
                if ok or not retry:
                    for fp, p in batch:
                        if self.pending.get(fp) is p:   # not replaced by a newer payload meanwhile
                            del self.pending[fp]
                self.healthy = ok
                if ok:
                    backoff, next_try = cfg.retry_backoff, 0.0
                elif retry:
                    next_try = time.monotonic() + backoff
                    backoff = min(backoff * 2, cfg.backoff_cap)
                if self.stopping:
                    return


class AlertmanagerPusher:
    """Sends the agent's firing and resolved alerts to every configured Alertmanager."""

    def __init__(self, config: AlertmanagerConfig, instance: str, generator_url: str = "",
                 on_error: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.instance = instance
        base = str(config.external_url).rstrip("/") if config.external_url else generator_url.rstrip("/")
        self.generator_url = f"{base}/api/v1/alerts" if base else ""
        self.on_error = on_error
        self._stats = _Stats()
        self._targets = [_Target(str(u), self) for u in config.urls]
        self._firing: dict[str, dict[str, Any]] = {}           # fingerprint -> payload (endsAt refreshed)
        self._resolved: dict[str, tuple[float, dict[str, Any]]] = {}  # re-sent for RESOLVED_RESEND_S
        self._last_resend: float | None = None
        self._opener = self._build_opener()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        for t in self._targets:
            t.thread.start()

    def stop(self) -> None:
        """Stop the senders; alerts still queued get one last attempt where the URL is healthy."""
        for t in self._targets:
            with t.cond:
                t.stopping = True
                t.cond.notify()
        deadline = time.monotonic() + self.config.timeout + 1   # one bound for all URLs together
        for t in self._targets:
            if t.thread.is_alive():
                t.thread.join(max(0.0, deadline - time.monotonic()))

    # -- the worker's side -------------------------------------------------------------------
    def sync(self, alerts: Iterable[Alert], now: float) -> None:
        """Diff the alert book against what was sent and queue what Alertmanager must hear.

        Pass every alert of the book (any state); pending ones are ignored. A firing alert that
        is no longer passed at all counts as resolved now. Cheap unless something changed or a
        resend is due.
        """
        lifetime = self.config.alert_lifetime
        out: list[tuple[str, dict[str, Any]]] = []
        seen: set[str] = set()
        for a in alerts:
            fp = a.fingerprint
            if a.state == AlertState.FIRING:
                seen.add(fp)
                if fp not in self._firing:
                    self._resolved.pop(fp, None)
                    self._firing[fp] = p = self._payload(a)
                    out.append((fp, {**p, "endsAt": rfc3339(now + lifetime)}))
            elif a.state == AlertState.RESOLVED and fp in self._firing:
                seen.add(fp)
                self._resolve(fp, a.resolved_at if a.resolved_at is not None else now, out)
        for fp in [fp for fp in self._firing if fp not in seen]:
            self._resolve(fp, now, out)   # vanished from the book while firing
        if self._last_resend is None or not 0 <= now - self._last_resend < self.config.resend_interval:
            self._last_resend = now
            fresh = {fp for fp, _ in out}
            out += [(fp, {**p, "endsAt": rfc3339(now + lifetime)}) for fp, p in self._firing.items()
                    if fp not in fresh]
            for fp, (at, p) in list(self._resolved.items()):
                if now - at > RESOLVED_RESEND_S:
                    del self._resolved[fp]
                elif fp not in fresh:
                    out.append((fp, p))
        if out:
            for t in self._targets:
                t.put(out)

    def _resolve(self, fp: str, at: float, out: list[tuple[str, dict[str, Any]]]) -> None:
        p = {**self._firing.pop(fp), "endsAt": rfc3339(at)}
        self._resolved[fp] = (at, p)
        while len(self._resolved) > self.config.queue_size:   # bounded, oldest first
            del self._resolved[next(iter(self._resolved))]
        out.append((fp, p))

    def _payload(self, a: Alert) -> dict[str, Any]:
        labels = {"instance": self.instance, **self.config.external_labels, **dict(a.labels), "alertname": a.rule}
        p: dict[str, Any] = {"labels": {k: v for k, v in labels.items() if v},
                             "annotations": {k: str(v) for k, v in a.annotations.items() if v},
                             "startsAt": rfc3339(a.fired_at if a.fired_at is not None else a.active_at)}
        if self.generator_url:
            p["generatorURL"] = self.generator_url
        return p

    # -- metrics -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """sent: alerts accepted by an Alertmanager (per URL); failed: failed requests;
        dropped: alerts given up (queue full, or refused as invalid); pending: queued now."""
        pending = 0
        for t in self._targets:
            with t.cond:
                pending += len(t.pending)
        with self._stats.lock:
            return {"sent": self._stats.sent, "failed": self._stats.failed,
                    "dropped": self._stats.dropped, "pending": pending}

    # -- HTTP --------------------------------------------------------------------------------
    def _build_opener(self) -> urllib.request.OpenerDirector:
        cfg = self.config
        ctx = ssl.create_default_context(cafile=str(cfg.ca_file) if cfg.ca_file else None)
        if cfg.cert_file is not None and cfg.key_file is not None:
            ctx.load_cert_chain(str(cfg.cert_file), str(cfg.key_file))
        if cfg.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        # No proxy from the environment: Alertmanager is an internal service (Prometheus' default).
        return urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                           urllib.request.HTTPSHandler(context=ctx))

    def _auth_header(self) -> str | None:
        """Credentials are read at every request so that rotated secrets take effect."""
        cfg = self.config
        if cfg.bearer_token_file is not None:
            return "Bearer " + cfg.bearer_token_file.read_text(encoding="utf-8").strip()
        if cfg.basic_auth is not None:
            ba = cfg.basic_auth
            pw = ba.password if ba.password_file is None else ba.password_file.read_text(encoding="utf-8").strip()
            return "Basic " + base64.b64encode(f"{ba.username}:{pw}".encode()).decode()
        return None

    def _post(self, url: str, payloads: list[dict[str, Any]]) -> tuple[bool, bool]:
        """POST one batch; returns (delivered, worth retrying)."""
        body = json.dumps(payloads, separators=(",", ":")).encode()
        try:
            headers = {"Content-Type": "application/json", "User-Agent": f"precision-agent/{__version__}"}
            auth = self._auth_header()
            if auth:
                headers["Authorization"] = auth
            req = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with self._opener.open(req, timeout=self.config.timeout) as resp:
                resp.read(65536)
            return True, True
        except urllib.error.HTTPError as exc:
            detail = exc.read(300).decode("utf-8", "replace").strip()
            retry = exc.code >= 500 or exc.code in (408, 429)
            self._report(f"alertmanager {url}: HTTP {exc.code} {detail}"
                         + ("" if retry else f" (batch of {len(payloads)} alert(s) refused, dropped)"))
            return False, retry
        except (OSError, HTTPException, ValueError) as exc:  # refused, timeout, TLS, unreadable secret
            self._report(f"alertmanager {url}: {type(exc).__name__}: {getattr(exc, 'reason', exc)}")
            return False, True
        except Exception as exc:  # a bug must cost this batch, not the sender thread (and all later pages)
            log.exception("alertmanager push to %s failed", url)
            self._report(f"alertmanager {url}: unexpected {type(exc).__name__}: {exc} (batch dropped)")
            return False, False

    def _report(self, message: str) -> None:
        if self.on_error is not None:
            self.on_error(message)
        else:
            log.warning("%s", message)


class AlertmanagerCollector(Collector):
    """``precision_agent_alertmanager_*`` on /metrics, read from ``AlertmanagerPusher.stats()``."""

    def __init__(self, pusher: AlertmanagerPusher) -> None:
        self.pusher = pusher

    def collect(self) -> Iterator[Metric]:
        s = self.pusher.stats()
        p = "precision_agent_alertmanager_"
        for key, name, help_ in (("sent", "alerts_sent", "Alerts accepted by an Alertmanager (counted per URL)."),
                                 ("failed", "requests_failed", "Failed pushes to an Alertmanager (each is retried)."),
                                 ("dropped", "alerts_dropped", "Alerts given up: queue full or refused as invalid.")):
            c = CounterMetricFamily(p + name, help_)
            c.add_metric([], s[key])
            yield c
        g = GaugeMetricFamily(p + "queue_length", "Alerts waiting to be pushed, summed over URLs.")
        g.add_metric([], s["pending"])
        yield g
