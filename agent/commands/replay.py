"""``replay``: run a finished log through the same reader, parsers, series state and rules the
daemon uses, and summarise what the agent would have seen and said.

JSON contract (one object): ``file, format, lines, records, unrecognized{sample[]} | null, steps{first,last}, loss_scale{first,min,
last,decreases,increases} | null, overflow_steps, nonfinite[{metric,step,line}],
spikes[{metric,step,line,value}], findings[{rule,kind,severity,step,line,summary}], precision,
loss_scaling, finished, attempts``. A TensorBoard event file or CSV metric log (agent/readers/streams.py)
gives the same object (``format`` ``tfevents`` or ``csv``, ``line`` the record or row number); the
records it could not read (bad CRC, damaged, torn at the end) go to ``warn``, one line per cause.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

from ..model import NONFINITE_MESSAGE, OVERFLOW, Sample
from ..engine.pipeline import Pipeline
from ..readers.filecursor import MetricFileStream
from ..readers.faultcodes import current_codes
from ..readers.metricmap import current_map
from ..readers.parsers.kernel_time import reference_time
from ..readers.streams import open_stream
from ..engine.rulefile import RuleSet
from ..series.state import SeriesState

READ_STEP = 4 << 20  # bytes per step: the samples of one step are what replay holds in memory


Progress = Callable[[int, int, int, int | None], None]  # (bytes read, file size, lines read, None)


def replay(path: Path, rules: RuleSet, fmt: str = "auto", labels: dict[str, str] | None = None,
           pattern: str | None = None, progress: Progress | None = None,
           warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    # fresh detectors: a rule set reused across files must not carry one file's history into the next
    pipeline = Pipeline(rules.fresh(), max_series=1 << 20, keep_findings=100_000)
    nonfinite: list[dict[str, Any]] = []

    def watch(sample: Sample, series: SeriesState) -> None:
        if sample.metric == NONFINITE_MESSAGE or (sample.metric != OVERFLOW and not math.isfinite(sample.value)):
            metric = sample.attr("what", sample.metric) if sample.metric == NONFINITE_MESSAGE else sample.metric
            nonfinite.append({"metric": metric, "step": _step(sample, series), "line": sample.source.line})

    pipeline.on_accepted = watch
    stream = open_stream(str(path), labels or {}, fmt, None, max_line_bytes=1 << 20, pattern=pattern)
    # a kernel log's syslog stamps carry no year: read them against the finished file's mtime
    with contextlib.ExitStack() as stack:
        stack.enter_context(reference_time(_mtime(path)))
        stack.callback(stream.close)
        now = time.time()
        size = os.stat(path).st_size if progress is not None else 0
        while True:  # bounded steps: a multi-GB log never sits in memory at once
            before = stream.stats.bytes
            pipeline.process(stream.poll(READ_STEP, now))
            if stream.stats.bytes == before:
                break
            if progress is not None:
                progress(min(stream.stats.bytes, size), size, stream.stats.lines, None)
        pipeline.process(stream.finish(now))  # the rest, and the last line even without "\n"
        if progress is not None:
            progress(size, size, stream.stats.lines, None)
    if warn is not None:
        for message in _warnings(stream):
            warn(message)
    series = list(pipeline.series.values())
    findings = [{"rule": f.rule, "kind": f.kind, "severity": f.severity, "step": f.step,
                 "line": f.source.line if f.source else None, "summary": f.annotations.get("summary") or f.summary}
                for f in pipeline.findings]
    spikes = [{"metric": f.evidence.get("metric"), "step": f.step, "line": f.source.line if f.source else None,
               "value": f.value} for f in pipeline.findings if f.kind == "spike"]
    return {
        "file": str(path),
        "format": stream.format,
        "lines": stream.stats.lines,
        "records": stream.stats.records,
        # no training record at all: the agent would be blind to this file (the daemon's
        # LogFormatUnrecognized); its last lines tell what it holds
        # (a kernel log read as such is never blind for holding no fault: Parser.sparse)
        "unrecognized": None if stream.stats.records or stream.parser.sparse
        else {"sample": stream.sample_lines()},
        "steps": _steps(series),
        "loss_scale": _loss_scale(series),
        "overflow_steps": sum(s.overflow_steps for s in series),
        "nonfinite": nonfinite,
        "spikes": spikes,
        "findings": findings,
        # what the run is (docs/rules.md, "Precision mode"): over every series of the file
        "precision": next((s.precision for s in series if s.precision), None),
        "loss_scaling": _loss_scaling(series),
        "finished": any(s.finished for s in series),
        "attempts": max((s.attempt for s in series), default=1),
    }


def _mtime(path: Path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _warnings(stream: Any) -> list[str]:
    """What the structured readers say once per cause (damaged records, with how many were not
    read), and a broken user map."""
    if not isinstance(stream, MetricFileStream):
        why = current_codes()[1]
        return [f"fault codes: {why}"] if why else []
    why = current_map()[1]
    out = [f"metric map: {why}"] if why else []
    if stream.stats.skipped:
        out.append(f"{stream.path}: {stream.stats.skipped} record(s) not read")
    return out + list(stream.parser.errors)


def _loss_scaling(series: list[SeriesState]) -> str:
    kinds = {s.loss_scaling for s in series}
    return "yes" if "yes" in kinds else ("no" if "no" in kinds else "unknown")


def _step(sample: Sample, series: SeriesState) -> int | None:
    return sample.step if sample.step is not None else series.last_step


def _steps(series: list[SeriesState]) -> dict[str, int | None]:
    firsts = [s.first_step for s in series if s.first_step is not None]
    lasts = [s.last_step for s in series if s.last_step is not None]
    return {"first": min(firsts) if firsts else None, "last": max(lasts) if lasts else None}


def _loss_scale(series: list[SeriesState]) -> dict[str, Any] | None:
    """One trajectory for the file: a single series as is; several (ranks) merged."""
    with_scale = [s for s in series if s.scale_first is not None]
    if not with_scale:
        return None
    return {"first": with_scale[0].scale_first,
            "min": min(s.scale_min for s in with_scale),
            "last": with_scale[-1].scale_last,
            "decreases": sum(s.scale_decreases for s in with_scale),
            "increases": sum(s.scale_increases for s in with_scale)}


def format_report(r: dict[str, Any]) -> str:
    """The human-readable replay report."""
    lines = [f"file:           {r['file']}",
             f"format:         {r['format'] or 'unknown'}",
             f"records:        {r['records']} (of {r['lines']} lines)",
             f"steps:          {r['steps']['first']} .. {r['steps']['last']}"]
    ls = r["loss_scale"]
    if ls:
        lines.append(f"loss scale:     first {ls['first']:g}, min {ls['min']:g}, last {ls['last']:g}; "
                     f"{ls['decreases']} decrease(s), {ls['increases']} increase(s)")
    else:
        lines.append("loss scale:     not printed by this log")
    lines.append(f"precision:      {r['precision'] or 'not stated'}; loss scaling {r['loss_scaling']}"
                 + ("; training finished" if r["finished"] else "")
                 + (f"; {r['attempts']} attempts" if r["attempts"] > 1 else ""))
    lines.append(f"overflow steps: {r['overflow_steps']}")
    if r["nonfinite"]:
        first = r["nonfinite"][0]
        lines.append(f"non-finite:     {len(r['nonfinite'])} value(s); first {first['metric']} at line {first['line']}"
                     + (f" (step {first['step']})" if first["step"] is not None else ""))
    else:
        lines.append("non-finite:     none")
    if r["spikes"]:
        lines.append(f"spikes:         {len(r['spikes'])}")
    runs = _runs(r["findings"])
    lines.append(f"findings:       {len(r['findings'])}"
                 + (f" (on {len(runs)} line(s): one per rule and fault, with how many records raised it)"
                    if len(runs) < len(r["findings"]) else ""))
    for f, n, last in runs[:50]:
        step = f" step {f['step']}" if f["step"] is not None else ""
        more = ""
        if n > 1:   # a persisting fault: one line, not one per record (--json keeps each finding)
            where = f"line {last['line']}" + (f", step {last['step']}" if last["step"] is not None else "")
            more = f" (and {n - 1} more" + (f", the last at {where})" if last["line"] != f["line"] else ")")
        lines.append(f"  [{f['severity']}] {f['rule']} line {f['line']}{step}: {f['summary']}{more}")
    if len(runs) > 50:
        lines.append(f"  ... and {len(runs) - 50} more (use --json)")
    return "\n".join(lines)


_AT_STEP = re.compile(r" at step -?\d+")


def _runs(findings: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int, dict[str, Any]]]:
    """Findings of one rule, severity and summary (its step aside: the same fault on another
    record) as (first, how many, last), in the order of their first; another metric or device
    is another summary."""
    out: dict[tuple[str, str, str], tuple[dict[str, Any], int, dict[str, Any]]] = {}
    for f in findings:
        k = f["rule"], f["severity"], _AT_STEP.sub("", f["summary"] or "")
        first, n, _last = out.get(k, (f, 0, f))
        out[k] = (first, n + 1, f)
    return list(out.values())
