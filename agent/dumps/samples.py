"""Where a dump becomes samples: a scan result (first bad op, Opdebug overflows, fp16
saturation, watched tensors) turned into the typed samples the rules judge. The daemon's scan
thread, ``precision-agent scan`` and ``rules test`` all call ``result_samples``, so they cannot
disagree."""

from __future__ import annotations

import json
import time
from typing import Any

from ..model import DUMP_FP16_SATURATED, DUMP_NONFINITE, DUMP_OVERFLOW, DUMP_STEP, Labels, Sample, SourcePos, make_labels
from .watchpoints import tensor_samples


def labelled(samples: list[Sample], labels: dict[str, str]) -> list[Sample]:
    """The scan thread's samples under a watch's labels (a sample's own, e.g. rank, win)."""
    if labels:
        for s in samples:
            s.labels = make_labels({**labels, **dict(s.labels)})
    return samples


MAX_MARKERS = 4096    # dump_step samples per scan result
MAX_OPS_PER_STEP = 16  # overflow / saturation samples per (step, rank): bounds the op labels


def _located(labels: dict[str, str], rank: Any) -> Labels:
    return make_labels(labels, rank=str(rank)) if rank is not None else make_labels(labels)


def fusion_attrs(found: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """A fusion suspect (agent/fusion/suspect.py) as sample attributes, for the fusion_suspect kind."""
    if not found or not found.get("kind"):
        return ()
    return (("fusion_kind", found["kind"]), ("fusion_api", found.get("api")),
            ("fusion_passes", tuple(found.get("passes") or ())), ("fusion_advice", found.get("advice") or ""),
            ("fusion_switch_cfg", json.dumps(found["switch_cfg"]) if found.get("switch_cfg") else None),
            ("fusion_fused_ops", tuple(found.get("fused_ops") or ())))


def uncertain_attrs(first: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A first bad op found after an unreadable tensor (agent/dumps/scan.py first_bad_op): the
    unreadable one may have been the true origin; its name and path go with the page."""
    if not first.get("uncertain"):
        return ()
    names = tuple(f"{u['op']} {u['tensor']} ({u['path']}: {u['reason']})"[:300]
                  for u in first.get("unreadable_before") or ())
    return (("uncertain", True), ("unreadable_before", names),
            ("unreadable_before_count", first.get("unreadable_before_count", len(names))))


def _nonfinite_sample(result: dict[str, Any], labels: dict[str, str], src: SourcePos, now: float,
                      ) -> list[Sample]:
    first = result.get("first_nonfinite")
    if first is None:
        return []
    bad = next((t for t in result["tensors"] if t["name"] == first["op"] and t["step"] == first["step"]
                and t["rank"] == first["rank"] and f"{t['io']}[{t['index']}]" == first["tensor"]), {})
    nonfinite = (bad.get("nan") or 0) + (bad.get("pos_inf") or 0) + (bad.get("neg_inf") or 0)
    attrs = (("op", first["op"]), ("tensor", first["tensor"]), ("rank", first["rank"]), ("nonfinite", nonfinite),
             ("order", op_order(result, first["op"], first["step"], first["rank"])),
             ("dtype", bad.get("dtype")), ("max", bad.get("max")), ("min", bad.get("min")),
             *fusion_attrs(result.get("fusion_suspect")), *uncertain_attrs(first))
    return [Sample(_located(labels, first["rank"]), DUMP_NONFINITE, float(nonfinite), first["step"], src, now,
                   None, attrs)]


def op_order(result: dict[str, Any], op: str, step: Any, rank: Any) -> int | None:
    """The position of ``op`` among the distinct ops of its (step, rank), in execution order (the
    order of ``tensors``): what ranks tied on a step are compared by (the same program runs the
    same ops in the same order on every rank)."""
    seen: set[str] = set()
    for t in result.get("tensors") or ():
        if t.get("step") != step or t.get("rank") != rank:
            continue
        if t["name"] == op:
            return len(seen)
        seen.add(t["name"])
    return None


def step_markers(result: dict[str, Any], labels: dict[str, str], src: SourcePos, now: float) -> list[Sample]:
    """One ``dump_step`` sample per (step, rank) the dump holds, in step order: whether any of its
    tensors holds NaN/Inf and whether an Opdebug file flagged an overflow in it. The incident kinds
    (agent/detectors/dump_incident.py) count clean steps and notice a restart (steps going back)
    with them. The step is an attr: ``Sample.step`` stays unset, as for the tensor samples."""
    seen: dict[tuple, list[bool]] = {}
    for t in result.get("tensors") or ():
        flags = seen.setdefault((t.get("step"), t.get("rank")), [False, False])
        if t.get("nan") or t.get("pos_inf") or t.get("neg_inf"):
            flags[0] = True
    for o in result.get("overflows") or ():
        seen.setdefault((o.get("step"), o.get("rank")), [False, False])[1] = True
    out = []
    for (step, rank), (bad, overflow) in sorted(seen.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0)):
        if len(out) >= MAX_MARKERS:
            break
        out.append(Sample(_located(labels, rank), DUMP_STEP, float(bad), None, src, now, None,
                          (("step", step), ("rank", rank), ("nonfinite", bad), ("overflow", overflow))))
    return out


def _overflow_samples(result: dict[str, Any], labels: dict[str, str], src: SourcePos, now: float,
                      ) -> list[Sample]:
    """One sample per overflowing op, earliest debug file first, at most MAX_OPS_PER_STEP
    distinct ops per (step, rank)."""
    seen: dict[tuple, set[str]] = {}
    out = []
    # no non-finite op: the first overflowing op is the scan's first bad op, and carries its suspicion
    fusion = () if result.get("first_nonfinite") else fusion_attrs(result.get("fusion_suspect"))
    for o in result.get("overflows") or []:
        op = o["op"] or f"task{o['task_id']}_stream{o['stream_id']}"  # its dump file is missing
        ops = seen.setdefault((o["step"], o["rank"]), set())
        if op in ops or len(ops) >= MAX_OPS_PER_STEP:
            continue
        ops.add(op)
        attrs = (("op", op), ("op_type", o["op_type"]), ("accelerator", o["accelerator"]),
                 ("status", o["status"]), ("status_code", hex(o["status_code"])), ("task_id", o["task_id"]),
                 ("stream_id", o["stream_id"]), ("rank", o["rank"]), ("debug_file", o["debug_file"]),
                 ("dump_file", o["file"]), *fusion)
        fusion = ()
        out.append(Sample(_located(labels, o["rank"]), DUMP_OVERFLOW, 1.0, o["step"], src, now, None, attrs))
    return out


def _saturation_samples(result: dict[str, Any], labels: dict[str, str], src: SourcePos, now: float,
                        ) -> list[Sample]:
    """One sample per op whose outputs hold fp16 values at ±65504, in execution order (the order
    of ``tensors``), at most MAX_OPS_PER_STEP ops per (step, rank); value = saturated count."""
    ops: dict[tuple, dict[str, dict[str, Any]]] = {}
    for t in result["tensors"]:
        if not t.get("fp16_saturated") or t["io"] in ("input", "param"):
            continue
        per_step = ops.setdefault((t["step"], t["rank"]), {})
        if t["name"] in per_step:
            per_step[t["name"]]["saturated"] += t["fp16_saturated"]
        elif len(per_step) < MAX_OPS_PER_STEP:
            per_step[t["name"]] = {"tensor": f"{t['io']}[{t['index']}]", "saturated": t["fp16_saturated"],
                                   "count": t["count"], "max": t["max"], "min": t["min"], "dtype": t["dtype"]}
    out = []
    for (step, rank), per_step in ops.items():
        for op, e in per_step.items():
            attrs = (("op", op), ("rank", rank), *e.items())
            out.append(Sample(_located(labels, rank), DUMP_FP16_SATURATED, float(e["saturated"]), step, src,
                              now, None, attrs))
    return out


def result_samples(result: dict[str, Any], labels: dict[str, str], source: str | None = None) -> list[Sample]:
    """Everything a scan result tells the rules, as samples: the first bad op (``dump_nonfinite``),
    one marker per (step, rank) (``dump_step``),
    the overflowing ops (``dump_overflow``), the fp16-saturated ops (``dump_fp16_saturated``)
    and the tensor-health watchpoints' samples. The daemon and ``precision-agent scan`` both
    judge exactly these, so the two cannot disagree."""
    src, now = SourcePos(source or result.get("path", ""), 0), time.time()
    out = _nonfinite_sample(result, labels, src, now)
    out += _overflow_samples(result, labels, src, now)
    out += _saturation_samples(result, labels, src, now)
    out += step_markers(result, labels, src, now)
    out += tensor_samples(result, labels)   # the one call site of the watchpoint kinds' samples
    return out
