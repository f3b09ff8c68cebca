"""Dump-side results on /metrics: cross-rank digests and compare outcomes, read as snapshots of
the dump result book (agent/dumps/results.py). Op names and steps are never labels here; the last
full comparison tables are served as JSON instead (``/api/v1/compare``).
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..dumps.results import DumpBook
from .metrics import P, label_keys, label_values


class DumpCollector(Collector):
    def __init__(self, book: DumpBook) -> None:
        self.book = book

    def collect(self) -> Iterator[Metric]:
        digests, compares = self.book.snapshot()
        keys = label_keys(k for k, _ in digests)
        d = GaugeMetricFamily(P + "dump_digest", "Digest (48 bits) of the tensors named by the watch's "
                              "`digest:` regex, latest dumped step of this rank.", labels=keys)
        s = GaugeMetricFamily(P + "dump_digest_step", "Step of precision_agent_dump_digest.", labels=keys)
        for labels, (step, value, _n) in digests:
            d.add_metric(label_values(labels, keys), value)
            s.add_metric(label_values(labels, keys), step)
        yield d
        yield s
        keys = label_keys(k for k, _ in compares)
        runs = CounterMetricFamily(P + "dump_compares", "Dump steps compared with the benchmark or rerun.",
                                   labels=keys)
        div = CounterMetricFamily(P + "dump_compares_diverged",
                                  "Dump steps whose comparison found a divergence.", labels=keys)
        pairs = GaugeMetricFamily(P + "dump_compare_pairs", "Tensor pairs in the last comparison.", labels=keys)
        diff = GaugeMetricFamily(P + "dump_compare_differing_tensors",
                                 "Tensor pairs that were not equal in the last comparison.", labels=keys)
        unm = GaugeMetricFamily(P + "dump_compare_unmatched_tensors",
                                "Tensors without a partner in the last comparison.", labels=keys)
        last = GaugeMetricFamily(P + "dump_compare_last_timestamp_seconds", "When the last comparison ended.",
                                 labels=keys)
        for labels, c in compares:
            v = label_values(labels, keys)
            runs.add_metric(v, c["runs"])
            div.add_metric(v, c["diverged"])
            pairs.add_metric(v, c["pairs"])
            diff.add_metric(v, c["differing"])
            unm.add_metric(v, c["unmatched"])
            last.add_metric(v, c["last"])
        yield from (runs, div, pairs, diff, unm, last)
        yield from origin_metrics(self.book.origins.snapshot())


def origin_metrics(items: list) -> Iterator[Metric]:
    """Each rank's first non-finite dump (agent/dumps/origins.py): one series per rank."""
    keys = sorted(set(label_keys(k for k, _ in items)) | {"op"})
    step = GaugeMetricFamily(P + "dump_first_nonfinite_step", "Step of this rank's first dump holding "
                             "NaN/Inf (this attempt); label op: its first bad op. The lowest across the "
                             "ranks of a run is where the incident started.", labels=keys)
    when = GaugeMetricFamily(P + "dump_first_nonfinite_timestamp_seconds", "When that dump was written "
                             "(its directory's newest modification time).", labels=keys)
    for labels, f in items:
        values = label_values(labels + (("op", f.op),), keys)
        if f.step is not None:
            step.add_metric(values, f.step)
        when.add_metric(values, f.when)
    yield step
    yield when
