"""A comparison as JSON, as CSV (msaccucmp's or msprobe's column layout) and as readable text.

JSON: ``{"pairs", "unmatched", "first_diverging_op", "corrupted_input", "first_differing_tensor",
"identical", "diverged", "verdict", "summary", "rows", ...}``. CSV numbers are ``'{:.6f}'`` and a
missing value is ``NaN`` (msaccucmp) or ``N/A`` (msprobe), as those tools write them.
"""

from __future__ import annotations

import math
from typing import IO, Any

from ..dumps.msprobe import inf_extremes
from ..dumps.types import DumpTensor
from ..model import TensorStats
from .engine import CompareResult, Row
from .metrics import RATIO_NAMES
from .pairing import tensor_label
from .verdict import stats_distance

MSACCUCMP_HEADER = ["Index", "OpType", "NPUDump", "DataType", "Address", "GroundTruth", "DataType",
                    "Address", "TensorIndex", "Shape", "CosineSimilarity", "MaxAbsoluteError",
                    "AccumulatedRelativeError", "RelativeEuclideanDistance", "KullbackLeiblerDivergence",
                    "StandardDeviation", "MeanAbsoluteError", "RootMeanSquareError", "MaxRelativeError",
                    "MeanRelativeError", "CompareFailReason"]
_MSPROBE_BASIC = ["NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape",
                  "Bench Tensor Shape"]
_MSPROBE_SIDES = ["NPU max", "NPU min", "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean",
                  "Bench l2norm", "Result", "Err_message"]
MSPROBE_TENSOR_HEADER = _MSPROBE_BASIC + ["Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr",
                                          "One Thousandth Err Ratio", "Five Thousandths Err Ratio"] + _MSPROBE_SIDES
MSPROBE_STATS_HEADER = _MSPROBE_BASIC + ["Max diff", "Min diff", "Mean diff", "L2norm diff", "MaxRelativeErr",
                                         "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr"] + _MSPROBE_SIDES


def verdict(res: CompareResult) -> str:
    """One word for the outcome (the JSON ``verdict``)."""
    if not res.rows:
        return "nothing_compared"
    if res.identical:
        return "identical"
    if res.mode == "rerun":
        return "nondeterministic" if res.diverged else "identical_where_paired"
    if res.first_diverging_op is not None:
        return res.first_diverging_op["kind"]      # lost_precision | threshold
    if res.corrupted_input is not None:
        return "input_differs"
    return "diverged" if res.diverged else "within_tolerance"


# what a statistics-only pair (msprobe statistics mode, statistic.csv) cannot give: they need data
TENSOR_ONLY_METRICS = ("CosineSimilarity", "RelativeEuclideanDistance", "MaxAbsoluteError",
                       "AccumulatedRelativeError", "KullbackLeiblerDivergence", "MeanAbsoluteError",
                       "RootMeanSquareError", "MaxRelativeError", "MeanRelativeError") + tuple(RATIO_NAMES)
STATS_METRICS = ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr")


def _num(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def distinct(v: Any, ref: float, digits: int = 3) -> str:
    """``v`` with as many significant digits as it takes not to read as ``ref`` (a cosine of
    0.9999996 is not "1"; a RED just over its tolerance is not the tolerance)."""
    if not isinstance(v, float) or not math.isfinite(v) or v == ref:
        return _num(v, digits)
    for p in range(digits, 18):
        if f"{v:.{p}g}" != f"{ref:.{p}g}":
            return f"{v:.{p}g}"
    return repr(v)  # pragma: no cover - v != ref always differs by 17 digits


def _where(d: dict[str, Any]) -> str:
    at = [f"{k} {d[k]}" for k in ("step", "rank") if d.get(k) is not None]
    return f"{d['op']} {d['tensor']}" + (f" ({', '.join(at)})" if at else "")


def _evidence(d: dict[str, Any]) -> str:
    m = d.get("metrics")
    if m:
        tol = d["tolerance"]
        return (f"RED {distinct(m.get('RelativeEuclideanDistance'), tol)} (tolerance {_num(tol)}), "
                f"cosine {distinct(m.get('CosineSimilarity'), 1.0, 6)}, max|Δ| {_num(m.get('MaxAbsoluteError'))}")
    if "stats_distance" in d:
        tol = d["tolerance"]
        return (f"statistics differ by {distinct(d['stats_distance'], tol)} relative (tolerance {_num(tol)}; "
                "a statistics dump has no cosine or RED)")
    return d.get("fail_reason", "")


def summary(res: CompareResult) -> str:
    """One sentence a person can act on."""
    v, f, c = verdict(res), res.first_diverging_op, res.corrupted_input
    if v == "nothing_compared":
        return "nothing was paired: the two trees share no tensor names"
    if v == "identical":
        return f"identical: all {len(res.rows)} paired tensors are bitwise equal"
    if v == "identical_where_paired":
        return f"all {len(res.rows)} paired tensors are bitwise equal; {len(res.unmatched)} unmatched"
    if v == "nondeterministic":
        return f"runs differ (nondeterminism): first differing op {_where(f)}" if f else "runs differ"
    if v == "lost_precision":
        text = (f"{f['op']} lost precision (step {f['step']}, rank {f['rank']}): its inputs match the "
                f"benchmark, its {f['tensor']} does not: {_evidence(f)}")
        if c is not None:
            text += f"; before it an input already differed: {_where(c)}"
        return text
    if v == "input_differs":
        return (f"no op lost precision: {_where(c)} differs from the benchmark before any dumped op "
                f"produced a difference, so an input from outside the dump (weight, batch, optimizer "
                f"state) was corrupted or changed: {_evidence(c)}")
    if v == "threshold":
        return f"first op over the {res.preset} thresholds: {_where(f)}: {_evidence(f)}"
    if v == "diverged":
        return "tensors beyond tolerance, but none in an op the strict rule can judge (see rows)"
    return f"no divergence under {res.preset}; {sum(not r.equal for r in res.rows)} tensors differ within tolerance"


def fusion_suspect(res: CompareResult) -> dict[str, Any] | None:
    """Whether the first diverging op is a fused API or an op fusion passes made (docs/fusion.md);
    across fusion, the fused APIs inside the first diverging module."""
    from ..fusion.suspect import CatalogueError, suspect
    from .across import module_suspect
    first = res.first_diverging_op
    op = (first or {}).get("op")
    try:
        if res.across is not None and res.across.level == "module":
            pair = res.rows[first["row"]].pair if first is not None else None
            found = module_suspect(first, pair and pair.target.name, pair and pair.bench.name, res.across)
        else:
            ctx = res.fusion
            found = suspect(op, getattr(ctx, "graph", None), getattr(ctx, "report", None))
    except CatalogueError:  # listed in the result's errors (engine.compare_sides)
        return None
    return found.to_json() if found is not None else None


def row_dict(r: Row) -> dict[str, Any]:
    t, b = r.target, r.bench
    out: dict[str, Any] = {
        "index": r.index, "step": t.step, "rank": t.rank, "op": t.name, "op_type": t.op_type,
        "tensor": tensor_label(t), "bench_op": b.name, "bench_tensor": tensor_label(b),
        "dtype": t.dtype, "bench_dtype": b.dtype, "shape": list(t.shape), "bench_shape": list(b.shape),
        "bitwise_equal": r.equal, "ok": r.ok, "tolerance": r.tolerance, "fail_reason": r.fail_reason}
    if r.diff is not None:
        out.update(metrics=dict(r.diff.metrics), count=r.diff.count, differ=r.diff.differ,
                   nonfinite_mismatch=r.diff.nonfinite_mismatch)
    if r.stats_diff is not None:
        out["stats_diffs"] = dict(r.stats_diff.diffs)
    out["compared_on"] = "tensors" if r.diff is not None else "statistics" if r.stats_diff is not None else None
    return out


def incident_of(res: CompareResult) -> dict[str, Any] | None:
    """A comparison over many steps as one incident, as the daemon's ``dump_divergence`` alerts
    it (agent/detectors/dump_incident.py): the origin is the op to look at first (lowest step),
    the affected steps every step with a pair beyond tolerance (with ``--rerun``: a differing bit)."""
    if not res.diverged:
        return None
    where = res.first_diverging_op or res.corrupted_input or res.first_differing_tensor or {}
    bad = sorted({r.target.step for r in res.rows if r.target.step is not None
                  and ((not r.equal) if res.mode == "rerun" else r.ok is False)})
    return {"origin_step": where.get("step"), "origin_rank": where.get("rank"), "op": where.get("op"),
            "tensor": where.get("tensor"), "affected_steps": bad[:64], "affected_steps_total": len(bad)}


def to_json(res: CompareResult) -> dict[str, Any]:
    """The JSON document (pass through ``model.json_safe`` before dumping: metrics may be NaN)."""
    return {"bench": res.bench.path, "target": res.target.path,
            "layouts": {"bench": res.bench.layout, "target": res.target.layout},
            "preset": res.preset, "mode": res.mode, "pairs": len(res.rows),
            "unmatched": res.unmatched, "first_diverging_op": res.first_diverging_op,
            "corrupted_input": res.corrupted_input, "first_differing_tensor": res.first_differing_tensor,
            "fusion_suspect": fusion_suspect(res),
            "across_fusion": res.across.to_json() if res.across is not None else None,
            "fused_away": res.across.fused_away if res.across is not None else [],
            "identical": res.identical, "diverged": res.diverged, "verdict": verdict(res),
            "incident": incident_of(res),
            "summary": summary(res), "differ_bitwise": sum(not r.equal for r in res.rows),
            "beyond_tolerance": sum(r.ok is False for r in res.rows), "errors": res.errors,
            "statistics_only": {"pairs": sum(r.diff is None and r.stats_diff is not None for r in res.rows),
                                "metrics": list(STATS_METRICS), "unavailable": list(TENSOR_ONLY_METRICS)},
            "rows": [row_dict(r) for r in res.rows]}


# ------------------------------------------------------------------------------------- CSV

def _fmt(v: Any, missing: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return missing
    return f"{float(v):.6f}"


def _tensor_index(t: DumpTensor) -> str:
    arg = t.extra.get("arg", t.index)
    return f"{t.name}:{'output' if t.io == 'output' else 'input'}:{arg}"


def _shape(t: DumpTensor) -> str:
    return "[" + ",".join(str(d) for d in t.shape) + "]"


def _std_cell(r: Row) -> str:
    """msaccucmp's "(mean_my;std_my),(mean_golden;std_golden)", 3 decimals, |v| < 0.001 as 0."""
    d = r.diff
    if d is None or d.target_stats is None or d.bench_stats is None:
        return "NaN"
    f = lambda v: "0" if abs(v) < 0.001 else f"{v:.3f}"  # noqa: E731
    (mt, st), (mb, sb) = d.target_stats, d.bench_stats
    return f"({f(mt)};{f(st)}),({f(mb)};{f(sb)})"


def _msaccucmp_row(i: int, t: DumpTensor | None, b: DumpTensor | None, r: Row | None) -> list[str]:
    side = t or b
    assert side is not None
    m = r.diff.metrics if r is not None and r.diff is not None else {}
    reason = r.fail_reason if r is not None else "no match on the other side"
    if r is not None and r.diff is None and r.stats_diff is not None:
        reason = "; ".join(s for s in ("statistics only", reason) if s)
    cells = [str(i), side.op_type or "NaN", t.name if t else "*", t.dtype if t else "NaN", "NaN",
             b.name if b else "*", b.dtype if b else "NaN", "NaN", _tensor_index(side), _shape(side)]
    for name in MSACCUCMP_HEADER[10:-1]:
        cells.append(_std_cell(r) if name == "StandardDeviation" and r is not None
                     else _fmt(m.get(name), "NaN"))
    return cells + [reason]


def _msprobe_name(t: DumpTensor) -> str:
    slot = t.extra.get("slot")
    if slot is None:
        return f"{t.name}.{t.io or 'output'}.{t.index}"
    kind = "input" if slot.startswith("input") else slot
    return f"{t.name}.{kind}.{t.extra.get('arg', t.index)}"


def _stat_cells(s: TensorStats | None) -> list[str]:
    if s is None:
        return ["N/A"] * 4
    mx, mn = inf_extremes(s.max, s.min, s.pos_inf, s.neg_inf)   # inf / -inf as msprobe writes them
    return [_fmt(v, "N/A") for v in (mx, mn, s.mean, s.l2norm)]


def _pct(v: float | None) -> str:
    """msprobe prints relative errors as percentages."""
    return "N/A" if v is None or math.isnan(v) else f"{abs(v) * 100:.2f}%"


def _msprobe_row(r: Row, stats_layout: bool) -> list[str]:
    t, b = r.target, r.bench
    ts, bs = r.target_stats or t.stats, r.bench_stats or b.stats
    cells = [_msprobe_name(t), _msprobe_name(b), t.dtype, b.dtype, str(list(t.shape)), str(list(b.shape))]
    if stats_layout:
        d = r.stats_diff.diffs if r.stats_diff is not None else {}
        cells += [_fmt(d.get(f"{k}Diff"), "N/A") for k in ("Max", "Min", "Mean", "Norm")]
        cells += [_pct(d.get(f"{k}RelativeErr")) for k in ("Max", "Min", "Mean", "Norm")]
    else:
        m = r.diff.metrics if r.diff is not None else {}
        rmse = m.get("RootMeanSquareError")
        euc = rmse * math.sqrt(r.diff.count) if rmse is not None and r.diff is not None else None
        cells += [_fmt(m.get("CosineSimilarity"), "N/A"), _fmt(euc, "N/A"),
                  _fmt(m.get("MaxAbsoluteError"), "N/A"), _fmt(m.get("MaxRelativeError"), "N/A")]
        cells += [_fmt(m.get(name), "N/A") for name in RATIO_NAMES]
    result = {True: "pass", False: "error", None: "N/A"}[r.ok]
    return cells + _stat_cells(ts) + _stat_cells(bs) + [result, r.fail_reason]


def write_csv(res: CompareResult, fh: IO[str], layout: str = "msaccucmp") -> None:
    """The full table: every pair, then the unmatched tensors of either side."""
    import csv   # here: only --csv writes one
    w = csv.writer(fh, lineterminator="\n")
    if layout == "msprobe":
        stats_layout = bool(res.rows) and all(r.diff is None for r in res.rows)
        w.writerow(MSPROBE_STATS_HEADER if stats_layout else MSPROBE_TENSOR_HEADER)
        for r in res.rows:
            w.writerow(_msprobe_row(r, stats_layout))
        return
    if layout != "msaccucmp":
        raise ValueError(f"unknown CSV layout {layout!r}")
    w.writerow(MSACCUCMP_HEADER)
    for r in res.rows:
        w.writerow(_msaccucmp_row(r.index, r.target, r.bench, r))
    for i, (side, t) in enumerate(res.unmatched_tensors, start=len(res.rows)):
        w.writerow(_msaccucmp_row(i, t if side == "target" else None, t if side == "bench" else None, None))


# ------------------------------------------------------------------------------------ text

def format_text(res: CompareResult, limit: int = 30) -> str:
    doc = to_json(res)
    lines = [f"bench:   {res.bench.path} ({res.bench.layout}, {len(res.bench.tensors)} tensors)",
             f"target:  {res.target.path} ({res.target.layout}, {len(res.target.tensors)} tensors)",
             f"preset:  {res.preset}   mode: {res.mode}",
             f"pairs:   {doc['pairs']}   unmatched: {len(res.unmatched)}   differ bitwise: "
             f"{doc['differ_bitwise']}   failing: {doc['beyond_tolerance']}",
             f"verdict: {doc['verdict']}: {doc['summary']}"]
    f = res.first_differing_tensor
    lines.append("first differing tensor: " + (f"{_where(f)}: {_evidence(f)}" if f else "none"))
    lines += _fusion_lines(doc)
    bad = [r for r in res.rows if r.ok is False]
    lines += _failing_tables(bad, limit)
    for u in res.unmatched[:limit]:
        lines.append(f"unmatched {u['side']}: {_where(u)}")
    if len(res.unmatched) > limit:
        lines.append(f"... {len(res.unmatched) - limit} more unmatched")
    for e in res.errors[:limit]:
        lines.append(f"error ({e['side']}): {e['path']}: {e['reason']}")
    return "\n".join(lines)




def _fusion_lines(doc: dict[str, Any]) -> list[str]:
    lines = []
    a = doc["across_fusion"]
    if a is not None:
        how = ("module entries (msprobe Module.*)" if a["level"] == "module"
               else f"the original-op mapping of {a['graph']}")
        lines.append(f"across fusion: the fusion-on run is the {a['fused_side']}; paired on {how}; "
                     f"{a['fused_away']} entries fused away (one run only, not errors)")
    s = doc["fusion_suspect"]
    if s is not None and s.get("kind"):
        what = ", ".join(s["passes"]) if s["passes"] else ", ".join(s.get("fused_ops") or ()) or s.get("api") or "op"
        lines.append(f"fusion suspect: {s['op']} ({s['kind']}: {what}): {s['advice']}")
    return lines


def _at(t: DumpTensor) -> str:
    return f"{_num(t.step):>5} {_num(t.rank):>4}"


def _failing_tables(bad: list[Row], limit: int) -> list[str]:
    """The failing pairs, tensor pairs and statistics-only pairs apart, each with the metrics it
    has, enough digits to see why it failed, and the tensor's full name last."""
    lines: list[str] = []
    tensors = [r for r in bad if r.diff is not None]
    stats = [r for r in bad if r.diff is None]
    if tensors:
        lines.append(f"{'step':>5} {'rank':>4} {'cosine':>12} {'RED':>10} {'tolerance':>10} {'max|Δ|':>10}  tensor")
        for r in tensors[:limit]:
            m = r.diff.metrics if r.diff is not None else {}
            lines.append(f"{_at(r.target)} {distinct(m.get('CosineSimilarity'), 1.0, 6):>12} "
                         f"{distinct(m.get('RelativeEuclideanDistance'), r.tolerance):>10} {_num(r.tolerance):>10} "
                         f"{_num(m.get('MaxAbsoluteError')):>10}  {r.target.name} {tensor_label(r.target)}"
                         + (f"  ({r.fail_reason})" if r.fail_reason else ""))
        if len(tensors) > limit:
            lines.append(f"... {len(tensors) - limit} more (--json or --csv for all)")
    if stats:
        lines.append("statistics only (no tensor data: cosine, RED and max|Δ| cannot be computed; relative "
                     "differences of max, min, mean and norm as msprobe's statistics compare gives them):")
        lines.append(f"{'step':>5} {'rank':>4} {'distance':>10} {'tolerance':>10} {'max rel':>9} {'min rel':>9} "
                     f"{'mean rel':>9} {'norm rel':>9}  tensor")
        for r in stats[:limit]:
            d = r.stats_diff.diffs if r.stats_diff is not None else {}
            dist = (stats_distance(r.target_stats, r.bench_stats)
                    if r.target_stats is not None and r.bench_stats is not None else None)
            rel = " ".join(f"{_pct(d.get(k)) if d.get(k) is not None else '-':>9}" for k in STATS_METRICS)
            lines.append(f"{_at(r.target)} {distinct(dist, r.tolerance):>10} {_num(r.tolerance):>10} {rel}  "
                         f"{r.target.name} {tensor_label(r.target)}" + (f"  ({r.fail_reason})" if r.fail_reason else ""))
        if len(stats) > limit:
            lines.append(f"... {len(stats) - limit} more (--json or --csv for all)")
    return lines
