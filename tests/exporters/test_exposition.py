"""``/metrics`` through exporters/exposition.py: byte-for-byte what prometheus_client renders of
the same families, in every format and escaping it negotiates, across scrapes whose series
come, go and change (the kept label strings must never go stale)."""

from __future__ import annotations

import gzip
import math
from typing import Iterator

import pytest
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from precision_agent.exporters.exposition import FORMATS_KEPT, Renderer, RowFamily, metrics_app

ACCEPTS = [
    None,
    "text/plain; version=0.0.4",
    "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text",
    # what Prometheus 3 sends by default
    "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=dots",
    "text/plain;version=1.0.0;escaping=values",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0;escaping=values",
]
HOSTILE = ["", "plain", 'quo"te', "back\\slash", "new\nline", "tab\there", "ünïcødé ✓", "{}=,", "\\n", "}", " "]
VALUES = [0, 1, -1, 0.5, -0.0, 1e-300, 1.5e300, 123456789.0, 1234567.0, 2**53 + 1, math.inf, -math.inf,
          math.nan, 65504.0, 3.0e38, 7]


class Fixed(Collector):
    """A registry's collector that yields what the test set last."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def families(series: list[tuple[str, ...]], keys: list[str], shift: float = 0.0) -> list[Metric]:
    """Plain families around row families, as the agent's collector yields them."""
    info = GaugeMetricFamily("precision_agent_build_info", "Build information.", labels=["version"])
    info.add_metric(["0.1"], 1)
    loss = RowFamily("precision_agent_training_loss", "Last loss \\ read\nfrom \"the\" log.", "gauge", keys)
    steps = RowFamily("precision_agent_training_samples", "Values read.", "counter", keys)
    nf = RowFamily("precision_agent_training_nonfinite_values", "NaN/Inf by metric.", "counter",
                   keys + ["metric"])
    for i, values in enumerate(series):
        loss.add(values, VALUES[i % len(VALUES)] + shift)
        steps.add(values, i * 3 + shift)
        for m in ("grad_norm", "loss"):
            nf.add(values + (m,), i)
    empty = RowFamily("precision_agent_training_step", "Last step.", "gauge", keys)
    errors = CounterMetricFamily("precision_agent_errors", "Errors by kind.", labels=["kind"])
    errors.add_metric(["parse"], 2)
    return [info, loss, steps, empty, errors, nf, GaugeMetricFamily("precision_agent_ready", "Ready.", value=1)]


def hostile_series(n: int, offset: int = 0) -> list[tuple[str, str, str]]:
    return [(HOSTILE[(i + offset) % len(HOSTILE)], str(i + offset), HOSTILE[(3 * i) % len(HOSTILE)])
            for i in range(n)]


@pytest.mark.parametrize("label_names", [["job", "rank", "zone"], ["a.b", "rank", "z"], ["rank", "job", "m"]])
def test_rendering_is_byte_identical_to_prometheus_client_across_scrapes(label_names: list[str]) -> None:
    registry = CollectorRegistry()
    fixed = Fixed()
    registry.register(fixed)
    renderer = Renderer()
    scrapes = [hostile_series(30), hostile_series(30), hostile_series(40, 5), hostile_series(3, 17), [],
               hostile_series(30)]
    for n, series in enumerate(scrapes):
        fixed.families = families(series, label_names, shift=n / 7)
        for accept in ACCEPTS:
            encoder, content_type = choose_encoder(accept)
            want = encoder(registry)
            got = renderer.render(registry, encoder, content_type)
            assert got == want, (accept, n)


def test_row_family_reads_as_the_plain_family() -> None:
    row = RowFamily("precision_agent_training_samples", "Values read.", "counter", ["job", "rank"])
    plain = CounterMetricFamily("precision_agent_training_samples", "Values read.", labels=["job", "rank"])
    for i, values in enumerate(hostile_series(8)):
        row.add(values[:2], i)
        plain.add_metric(values[:2], i)
    assert row == plain and row.samples == plain.samples
    with pytest.raises(ValueError):
        row.add(("only one",), 1)
    with pytest.raises(ValueError):
        RowFamily("precision_agent_x", "x", "histogram", [])
    with pytest.raises(TypeError):   # never a sample silently lost
        row.add_sample("precision_agent_training_samples_total", {"job": "a", "rank": "0"}, 1)


def test_kept_label_strings_are_bounded_by_the_latest_scrape_and_formats() -> None:
    registry = CollectorRegistry()
    fixed = Fixed()
    registry.register(fixed)
    renderer = Renderer()
    encoder, content_type = choose_encoder(None)
    fixed.families = families(hostile_series(200), ["job", "rank", "zone"])
    renderer.render(registry, encoder, content_type)
    many = renderer.kept()
    fixed.families = families(hostile_series(5, 1000), ["job", "rank", "zone"])
    renderer.render(registry, encoder, content_type)
    assert renderer.kept() < many / 10, "label strings of series no longer exported must go"
    for accept in ACCEPTS + [f"application/openmetrics-text;version=1.0.{i}" for i in range(20)]:
        renderer.render(registry, *choose_encoder(accept))
    assert renderer.formats() <= FORMATS_KEPT


def wsgi_get(app, path: str = "/metrics", method: str = "GET", **headers: str) -> tuple[str, dict, bytes]:
    got: dict = {}

    def start_response(status: str, hdrs: list) -> None:
        got["status"], got["headers"] = status, dict(hdrs)
    path, _, query = path.partition("?")
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query, **headers}
    body = b"".join(app(environ, start_response))
    return got["status"], got["headers"], body


def test_the_app_serves_what_make_wsgi_app_serves() -> None:
    registry = CollectorRegistry(auto_describe=True)   # described at registration: name[] can find them
    fixed = Fixed()
    fixed.families = families(hostile_series(25), ["job", "rank", "zone"])
    registry.register(fixed)
    ours, theirs = metrics_app(registry), make_wsgi_app(registry)
    for accept in ACCEPTS:
        for encoding in (None, "gzip", "deflate, gzip;q=0.5", "identity"):
            headers = {k: v for k, v in (("HTTP_ACCEPT", accept), ("HTTP_ACCEPT_ENCODING", encoding)) if v}
            a, b = wsgi_get(ours, **headers), wsgi_get(theirs, **headers)
            assert a[0] == b[0] == "200 OK"
            assert a[1] == b[1], (accept, encoding)
            unzip = gzip.decompress if a[1].get("Content-Encoding") == "gzip" else (lambda x: x)
            assert unzip(a[2]) == unzip(b[2])
    # a name[] filter and other methods: prometheus_client's own answer
    for path, method in (("/metrics?name[]=precision_agent_training_loss", "GET"), ("/metrics", "HEAD"),
                         ("/metrics", "POST")):
        a, b = wsgi_get(ours, path, method), wsgi_get(theirs, path, method)
        assert a == b
    assert b"precision_agent_training_loss{" in wsgi_get(ours, "/metrics?name[]=precision_agent_training_loss")[2]
