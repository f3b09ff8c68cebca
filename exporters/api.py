"""The JSON API's documents (``/api/v1/alerts``, ``/api/v1/status``): snapshots taken under the
pipeline lock, rendered by the HTTP exporter; kept apart from the daemon's worker loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import __version__, kernels
from ..model import AlertState
from ..engine.pipeline import Pipeline

if TYPE_CHECKING:  # pragma: no cover - typing only (the daemon imports this module)
    from ..daemon.agent import Agent


def alerts_json(pipeline: Pipeline) -> dict[str, Any]:
    """Pending and firing alerts with their evidence."""
    with pipeline.lock:
        return {"alerts": [a.to_json() for a in pipeline.alerts.alerts.values() if a.state != AlertState.RESOLVED]}


def status_json(agent: "Agent") -> dict[str, Any]:
    """Watches, followed files, series, rules and their errors, counters, kernels in use."""
    counters, errors, gauges = agent.health.snapshot()
    pipeline = agent.pipeline
    with pipeline.lock:
        series = [{"labels": dict(s.labels), **s.to_dict(), "loss_scaling": s.loss_scaling}
                  for s in pipeline.series.values()]
        rule_errors = {f: str(e) for f, e in pipeline.rules.errors.items()}
        rules = [{"alert": r.name, "kind": r.spec.kind, "file": r.file, "group": r.group}
                 for r in pipeline.rules.rules]
    files = [{"path": p, "format": s.format, "lines": s.stats.lines, "records": s.stats.records}
             for p, s in list(agent.streams.items())]
    watches = [{"path": str(w.path), "kind": w.kind, "labels": w.labels,
                "mode": agent.watcher.modes.get(str(w.path), "pending")} for w in agent.config.watches]
    return {"version": __version__, "ready": bool(gauges["ready"]), "kernels": kernels.active(),
            "watches": watches, "files": files, "series": series, "rules": rules,
            "rule_errors": rule_errors, "counters": counters, "errors": errors}
