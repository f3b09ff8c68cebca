"""``/api/v1/alerts`` from ``AlertsView``: the same bytes as the whole document rendered at each
request, rendered once per change of the alert book and, then, only for the alerts that changed."""

import json
import math
import textwrap
import threading

from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import load_rules
from precision_agent.exporters.api import AlertsView, alerts_json
from precision_agent.model import GRAD_NORM, LOSS, AlertState, Sample, SourcePos, json_safe

RULES = """
groups:
  - name: t
    rules:
      - alert: NaN
        kind: nonfinite
        params: {grad_norm_persist: 1, grad_norm_warmup: 0}
        resolve_after: 60s
        labels: {severity: page}
        annotations: {summary: "non-finite {{ $value }}"}
"""


def pipeline(tmp_path):
    (tmp_path / "r.yml").write_text(textwrap.dedent(RULES))
    return Pipeline(load_rules([tmp_path]))


def bad(run, t, step=1, metric=LOSS):
    return Sample((("run", run),), metric, math.nan, step, SourcePos(f"{run}.log", step), t)


def whole(p):
    """What the HTTP exporter answered before the view: the document rendered at each request."""
    return json.dumps({"status": "success", "data": json_safe(alerts_json(p))}, default=str, allow_nan=False,
                      separators=(",", ":")).encode()


def step(p, view, samples=(), tick=None):
    """One worker step: change the book, then tell the view, as agent/daemon/worker.py does."""
    if samples:
        p.process(list(samples))
    if tick is not None:
        p.tick(tick)
    view.changed(p.alerts.dirty | p.alerts.deleted)
    p.alerts.committed()


def test_same_bytes_as_the_whole_document_and_rendered_once_per_change(tmp_path):
    p = pipeline(tmp_path)
    view = AlertsView(p)
    assert view.body() == whole(p) == b'{"status":"success","data":{"alerts":[]}}'
    step(p, view, [bad(f"r{i}", 100.0 + i) for i in range(30)])
    body = view.body()
    assert body == whole(p)
    doc = json.loads(body)["data"]["alerts"]
    assert len(doc) == 30 and {a["state"] for a in doc} == {"firing"}
    assert doc[0]["evidence"]["value"] == "NaN"      # NaN as Prometheus' API writes it
    renders, fragments = view.renders, view.fragments_rendered
    for _ in range(50):                               # polls between changes: nothing is serialised
        assert view.body() is body
    assert (view.renders, view.fragments_rendered) == (renders, fragments)

    step(p, view, [bad("r7", 200.0, step=2)])          # one alert hit again: only it is rendered
    body = view.body()
    assert body == whole(p)
    assert view.fragments_rendered == fragments + 1
    (r7,) = [a for a in json.loads(body)["data"]["alerts"] if a["labels"]["run"] == "r7"]
    assert r7["count"] == 2 and r7["evidence"]["latest"]["step"] == 2

    step(p, view, [bad("new", 201.0, metric=GRAD_NORM)])   # a new alert: the others are kept
    assert view.body() == whole(p)
    assert view.fragments_rendered == fragments + 2


def test_resolved_alerts_leave_the_body(tmp_path):
    p = pipeline(tmp_path)
    view = AlertsView(p)
    step(p, view, [bad("a", 100.0), bad("b", 150.0)])
    assert len(json.loads(view.body())["data"]["alerts"]) == 2
    step(p, view, tick=190.0)                          # a: 60 s without a hit; b not yet
    assert {dict(a.labels)["run"]: a.state for a in p.alerts.alerts.values()} == {
        "a": AlertState.RESOLVED, "b": AlertState.FIRING}
    body = view.body()
    assert body == whole(p)
    assert [a["labels"]["run"] for a in json.loads(body)["data"]["alerts"]] == ["b"]


def test_a_change_during_a_render_is_rendered_at_the_next_request(tmp_path):
    """The worker changes the book while a request renders: that render may show either state,
    the next one shows the change (never a cached body older than the last change)."""
    p = pipeline(tmp_path)
    view = AlertsView(p)
    step(p, view, [bad(f"r{i}", 100.0) for i in range(20)])
    stop = threading.Event()
    seen: list[bytes] = []

    def poll():
        while not stop.is_set():
            seen.append(view.body())

    pollers = [threading.Thread(target=poll) for _ in range(3)]
    for t in pollers:
        t.start()
    try:
        for k in range(200):
            step(p, view, [bad(f"r{k % 20}", 101.0 + k, step=k + 2)])
            assert view.body() == whole(p)
    finally:
        stop.set()
        for t in pollers:
            t.join()
    assert seen and view.body() == whole(p)
