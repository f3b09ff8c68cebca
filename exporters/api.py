"""The JSON API's documents (``/api/v1/alerts``, ``/api/v1/status``): snapshots taken under the
pipeline lock, rendered by the HTTP exporter; kept apart from the daemon's worker loop."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .. import __version__, kernels
from ..config import Watch
from ..engine.pipeline import Pipeline
from ..health import Health
from ..model import AlertState
from ..readers.logstream import LogStream


def alerts_json(pipeline: Pipeline) -> dict[str, Any]:
    """Pending and firing alerts with their evidence."""
    with pipeline.lock:
        return {"alerts": [a.to_json() for a in pipeline.alerts.alerts.values() if a.state != AlertState.RESOLVED]}


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
