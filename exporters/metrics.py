"""``/metrics``: a custom collector that renders the agent's state at scrape time.

Built from snapshots rather than global Counter/Gauge objects, so a scrape is consistent,
series of evicted runs disappear without bookkeeping, and label sets stay bounded by the
pipeline's ``max_series``. Training series carry only the labels from the watch config plus
``rank``; never paths, steps or op names.
"""

from __future__ import annotations

import platform
from typing import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..dumps.cache import CAUSES
from ..health import Health
from ..model import EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, Labels
from ..engine.pipeline import Pipeline
from .exposition import RowFamily
from .. import __version__, kernels

P = "precision_agent_"
_GAUGES = ((LOSS, "training_loss", "Last training loss read from the log."),
           (EVAL_LOSS, "training_eval_loss", "Last validation/eval loss read from the log."),
           (LOSS_SCALE, "training_loss_scale", "Last dynamic loss scale read from the log."),
           (GRAD_NORM, "training_grad_norm", "Last gradient norm read from the log."),
           (LEARNING_RATE, "training_learning_rate", "Last learning rate read from the log."))


def label_keys(label_sets: Iterable[Labels]) -> list[str]:
    keys: set[str] = set()
    for labels in label_sets:
        keys.update(k for k, _ in labels)
    return sorted(keys)


def label_values(labels: Labels, keys: list[str]) -> tuple[str, ...]:
    d = dict(labels)
    return tuple(d.get(k, "") for k in keys)


# catching up on followed logs, and the descriptors it holds (readers/following.py, daemon/fdlimit.py)
BACKLOG_GAUGES = (
    ("log_unread_bytes", "Bytes written to followed log files and not read yet (0 once caught up; "
     "a value that stays high means a file is stalled)."),
    ("log_files_behind", "Followed log files with unread bytes."),
    ("log_files_open", "Descriptors held on followed log files (at most max_open_files)."),
    ("max_open_files", "Descriptors the agent may hold on log files: limits.max_open_files, lowered "
     "at start when RLIMIT_NOFILE cannot hold it with the agent's other descriptors."),
    ("max_open_files_lowered", "1 when max_open_files was lowered below limits.max_open_files to fit "
     "RLIMIT_NOFILE (raise LimitNOFILE= / ulimit -n)."),
)


class AgentCollector(Collector):
    def __init__(self, health: Health, pipeline: Pipeline) -> None:
        self.health = health
        self.pipeline = pipeline

    def collect(self) -> Iterator[Metric]:
        yield from self._health()
        with self.pipeline.lock:
            series = [(s.labels, s.last.copy(), s.last_step, s.overflow_steps, s.scale_decreases,
                       dict(s.nonfinite), s.records, s.last_update, s.first_nonfinite_step, s.first_nonfinite_time)
                      for s in self.pipeline.series.values()]
            alerts = [(a.rule, a.state.value, a.labels) for a in self.pipeline.alerts.alerts.values()
                      if a.state.value != "resolved"]
            findings = dict(self.pipeline.findings_total)
            evicted = self.pipeline.evicted_series
            faults = sorted(self.pipeline.suspects.ledger.counts.items())
        yield from self._training(series)
        yield from self._alerts(alerts, findings)
        c = CounterMetricFamily(P + "series_evicted", "Training series dropped to keep label cardinality bounded.")
        c.add_metric([], evicted)
        yield c
        hw = CounterMetricFamily(P + "hardware_faults", "Device faults read from kernel logs (format: kernel), by "
                                 "device, code and class (hardware | application | unknown).",
                                 labels=["device", "code", "class"])
        for key, n in faults:
            hw.add_metric(list(key), n)
        yield hw

    def _health(self) -> Iterator[Metric]:
        counters, errors, gauges = self.health.snapshot()
        info = GaugeMetricFamily(P + "build_info", "Build information of the agent.",
                                 labels=["version", "python_version"])
        info.add_metric([__version__, platform.python_version()], 1)
        yield info
        kinfo = GaugeMetricFamily(P + "kernel_info", "Block kernels in use: impl is c (compiled, one "
                                  "pass per block) or numpy (fallback).", labels=["kind", "impl"])
        for kind, impl in kernels.active().items():
            kinfo.add_metric([kind, impl], 1)
        yield kinfo
        g = GaugeMetricFamily(P + "start_time_seconds", "Start time of the agent, seconds since epoch.")
        g.add_metric([], self.health.start_time)
        yield g
        g = GaugeMetricFamily(P + "watched_files", "Files currently followed.", labels=["kind"])
        g.add_metric(["log"], gauges["watched_log_files"])
        g.add_metric(["dump"], gauges["watched_dump_files"])
        yield g
        for name, help_ in BACKLOG_GAUGES:
            g = GaugeMetricFamily(P + name, help_)
            g.add_metric([], gauges[name])
            yield g
        g = GaugeMetricFamily(P + "rule_files", "Rule files by load state.", labels=["state"])
        g.add_metric(["ok"], gauges["rule_files_ok"])
        g.add_metric(["error"], gauges["rule_files_error"])
        yield g
        for name, help_ in (("rules_loaded", "Rules in force."),
                            ("ready", "1 once watches are set up and the agent is processing."),
                            ("last_commit_timestamp_seconds", "Time of the last state-store commit."),
                            ("config_restart_needed", "1 while the config file on disk differs from the "
                             "running configuration in a setting that takes effect at restart."),
                            ("log_files_unrecognized", "Followed files that grow but yield no record (no parser "
                             "recognises them, or their records stopped): LogFormatUnrecognized, LogRecordsStopped."),
                            ("state_unsaved", "1 while the state store cannot be written (disk full, I/O "
                             "error): the agent alerts from memory and retries the save.")):
            g = GaugeMetricFamily(P + name, help_)
            g.add_metric([], gauges[name])
            yield g
        for name, help_ in (("log_lines_read", "Complete log lines read."),
                            ("log_bytes_read", "Log bytes read."),
                            ("log_records_parsed", "Log records recognised by a parser."),
                            ("log_lines_truncated", "Log lines cut at limits.max_line_bytes."),
                            ("metric_records_skipped", "Records of TensorBoard event files and CSV metric logs "
                             "not read (bad CRC, damaged framing, over the size limit, torn at the end)."),
                            ("log_rotations", "Log rotations (rename) followed."),
                            ("log_truncations", "Log truncations (copytruncate) followed."),
                            ("dump_files_scanned", "Tensor-dump files read by scans (an unchanged file is not "
                             "read again)."),
                            ("watch_events", "File-system events received."),
                            ("resyncs", "Reconciliation passes: each walks the watched trees and compares every file with "
                             "what was read (periodic, and at once after a queue overflow or a lost watch)."),
                            ("queue_overflows", "Times the change queue was full and a resync was forced."),
                            ("symlinks_skipped", "Symlinks in watched trees not followed: their target is "
                             "outside the watched roots (follow_symlinks: true on the watch allows it).")):
            c = CounterMetricFamily(P + name, help_)
            c.add_metric([], counters[name])
            yield c
        for name, label, help_ in (
                ("state_save_failures", "cause", "Failed state saves by cause (disk full, I/O error, ...)."),
                ("state_rows_quarantined", "table", "Damaged rows of the state database set aside at start.")):
            c = CounterMetricFamily(P + name, help_, labels=[label])
            for value, n in sorted(self.health.labelled_snapshot(name).items()):
                c.add_metric([value], n)
            yield c
        c = CounterMetricFamily(P + "dump_unreadable", "Dump files (or tensors) found unreadable by a scan, "
                                "by cause (io, truncated, limit, invalid): counted each time a changed file "
                                "fails, logged once per change.", labels=["cause"])
        for cause in CAUSES:
            c.add_metric([cause], counters.get(f"dump_unreadable_{cause}", 0.0))
        yield c
        for what in ("rule", "config"):
            c = CounterMetricFamily(P + f"{what}_reloads", f"{what.capitalize()} reloads (SIGHUP) by result.",
                                    labels=["result"])
            c.add_metric(["success"], counters[f"{what}_reloads_success"])
            c.add_metric(["failure"], counters[f"{what}_reloads_failure"])
            yield c
        stalled = GaugeMetricFamily(P + "worker_stalled", "1 while a worker thread is busy without progress "
                                    "for limits.worker_stall_timeout (then /-/ready is 503 and the systemd "
                                    "watchdog is not fed).", labels=["worker"])
        last = GaugeMetricFamily(P + "worker_heartbeat_timestamp_seconds", "When a worker thread last made "
                                 "progress, seconds since epoch.", labels=["worker"])
        for name, when, is_stalled in self.health.worker_states():
            stalled.add_metric([name], 1.0 if is_stalled else 0.0)
            last.add_metric([name], when)
        yield stalled
        yield last
        c = CounterMetricFamily(P + "errors", "Errors by kind; each also has a log line.", labels=["kind"])
        for kind, v in errors.items():
            c.add_metric([kind], v)
        yield c

    def _training(self, series: list) -> Iterator[Metric]:
        # row families: their label strings are kept between scrapes (exporters/exposition.py)
        keys = label_keys(s[0] for s in series)
        values = [label_values(s[0], keys) for s in series]   # each series' label values, once
        for metric, name, help_ in _GAUGES:
            g = RowFamily(P + name, help_, "gauge", keys)
            for vals, (_, last, *_) in zip(values, series):
                if metric in last:
                    g.add(vals, last[metric])
            yield g
        g = RowFamily(P + "training_step", "Last training step seen.", "gauge", keys)
        u = RowFamily(P + "training_last_update_timestamp_seconds",
                      "When the agent last read a record of this series.", "gauge", keys)
        ov = RowFamily(P + "training_overflow_steps",
                       "Logical overflow (skipped) steps, deduplicated across ranks.", "counter", keys)
        dec = RowFamily(P + "training_loss_scale_decreases", "Observed loss-scale decreases.", "counter", keys)
        rec = RowFamily(P + "training_samples", "Values read for this series (a record holds several).",
                        "counter", keys)
        nf = RowFamily(P + "training_nonfinite_values", "NaN/Inf values or messages by metric.", "counter",
                       keys + ["metric"])
        first = RowFamily(P + "training_first_nonfinite_step",
                          "Step of the series' first NaN/Inf of the current attempt (no scaler's skipped "
                          "step); the lowest across the ranks of a run names where an incident started.",
                          "gauge", keys)
        first_t = RowFamily(P + "training_first_nonfinite_timestamp_seconds",
                            "When that first NaN/Inf happened (the line's time stamp where it has one).",
                            "gauge", keys)
        for vals, (_, last, step, overflow, decreases, nonfinite, records, updated, nf_step, nf_time) \
                in zip(values, series):
            if nf_step is not None:
                first.add(vals, nf_step)
            if nf_time is not None:
                first_t.add(vals, nf_time)
            if step is not None:
                g.add(vals, step)
            u.add(vals, updated)
            ov.add(vals, overflow)
            dec.add(vals, decreases)
            rec.add(vals, records)
            for m in (LOSS, GRAD_NORM):
                nonfinite.setdefault(m, 0)
            for m, n in sorted(nonfinite.items()):
                nf.add(vals + (m,), n)
        yield from (g, u, ov, dec, rec, nf, first, first_t)

    def _alerts(self, alerts: list, findings: dict[str, int]) -> Iterator[Metric]:
        keys = [k for k in label_keys(a[2] for a in alerts) if k not in ("alertname", "alertstate")]
        g = RowFamily(P + "alerts", "Active alerts, in the shape of Prometheus' ALERTS series.", "gauge",
                      ["alertname", "alertstate"] + keys)
        for rule, state, labels in alerts:
            g.add((rule, state, *label_values(labels, keys)), 1)
        yield g
        c = CounterMetricFamily(P + "findings", "Detector findings by rule.", labels=["alertname"])
        for rule, n in sorted(findings.items()):
            c.add_metric([rule], n)
        yield c
