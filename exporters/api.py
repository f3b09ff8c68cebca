"""The JSON API's documents (``/api/v1/alerts``, ``/api/v1/status``): snapshots taken under the
pipeline lock, rendered by the HTTP exporter; kept apart from the daemon's worker loop.

``/api/v1/alerts`` is polled (dashboards, scripts waiting for a page) while alerts pile up, each
with its evidence: ``AlertsView`` serves it from a body rendered once per change of the alert book
(the worker says which alerts changed, from the book's own dirty marks), and re-renders only the
alerts that changed. A poll between changes costs no serialisation at all."""

from __future__ import annotations

import threading
from typing import Any, Iterable, Mapping

from .. import __version__, kernels
from ..config import Watch
from ..engine.pipeline import Pipeline
from ..health import Health
from ..model import Alert, AlertState, json_safe
from ..readers.logstream import LogStream
from .http import json_bytes


def alerts_json(pipeline: Pipeline) -> dict[str, Any]:
    """Pending and firing alerts with their evidence."""
    with pipeline.lock:
        return {"alerts": [a.to_json() for a in pipeline.alerts.alerts.values() if a.state != AlertState.RESOLVED]}


def _dumps(doc: Any) -> bytes:
    """The HTTP exporter's JSON encoding of ``doc``, NaN/Inf as strings."""
    return json_bytes(json_safe(doc))


ALERTS_HEAD, ALERTS_TAIL = b'{"status":"success","data":{"alerts":[', b"]}}"


class AlertsView:
    """The finished ``/api/v1/alerts`` body (the same bytes as ``alerts_json`` rendered whole),
    cached per generation of the alert book, with one cached fragment per alert.

    The owner of the pipeline (the daemon's worker) calls ``changed`` with the fingerprints of the
    alerts it changed or dropped (the book's ``dirty`` and ``deleted``, the marks the state store
    saves by), after the change and outside the pipeline lock. A render reads the generation
    before it looks at the book, so a change made during a render is rendered again at the next
    request; renders are one at a time, so no render can put back a fragment older than the last."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.generation = 0
        self.renders = 0                    # bodies rendered (tests, and the bench's account)
        self.fragments_rendered = 0         # alerts serialised
        self._marks = threading.Lock()      # guards generation and _stale (the worker's side)
        self._render = threading.Lock()     # one render at a time; held across the pipeline lock
        self._stale: set[str] = set()
        self._fragments: dict[str, bytes] = {}
        self._body: tuple[int, bytes] = (-1, b"")

    def changed(self, fingerprints: Iterable[str]) -> None:
        with self._marks:
            self._stale.update(fingerprints)
            self.generation += 1

    def body(self) -> bytes:
        with self._render:
            with self._marks:
                gen = self.generation
                if self._body[0] == gen:
                    return self._body[1]
                stale, self._stale = self._stale, set()
            old = self._fragments
            parts: dict[str, bytes] = {}
            with self.pipeline.lock:
                active: list[Alert] = [a for a in self.pipeline.alerts.alerts.values()
                                       if a.state != AlertState.RESOLVED]
                for a in active:
                    fp = a.fingerprint
                    frag = old.get(fp) if fp not in stale else None
                    if frag is None:
                        frag = _dumps(a.to_json())
                        self.fragments_rendered += 1
                    parts[fp] = frag
            self._fragments = parts          # alerts gone from the book leave the cache
            body = ALERTS_HEAD + b",".join(parts.values()) + ALERTS_TAIL
            self._body = (gen, body)
            self.renders += 1
            return body


def status_json(health: Health, pipeline: Pipeline, streams: Mapping[str, LogStream], watches: Iterable[Watch],
                modes: Mapping[str, str], blind: Mapping[str, str] | None = None,
                unread: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Watches (with their watch mode), followed files (with ``unrecognized``: null, or why the
    agent reads no record from the file, agent/readers/yields.py; and their unread bytes, from
    ``unread``), series, rules and their errors, counters, kernels in use."""
    counters, errors, gauges = health.snapshot()
    with pipeline.lock:
        series = [{"labels": dict(s.labels), **s.to_dict(), "loss_scaling": s.loss_scaling}
                  for s in pipeline.series.values()]
        rule_errors = {f: str(e) for f, e in pipeline.rules.errors.items()}
        rules = [{"alert": r.name, "kind": r.spec.kind, "file": r.file, "group": r.group}
                 for r in pipeline.rules.rules]
    blind = blind or {}
    files = [{"path": p, "format": s.format, "lines": s.stats.lines, "records": s.stats.records,
              "unrecognized": blind.get(p)} for p, s in list(streams.items())]
    for f in files:  # written and not read yet: a file that stays behind is stalled
        f["unread_bytes"] = (unread or {}).get(f["path"], 0)
    watches = [{"path": str(w.path), "kind": w.kind, "labels": w.labels,
                "mode": modes.get(str(w.path), "pending")} for w in watches]
    return {"version": __version__, "ready": bool(gauges["ready"]), "kernels": kernels.active(),
            "watches": watches, "files": files, "series": series, "rules": rules,
            "rule_errors": rule_errors, "counters": counters, "errors": errors}
