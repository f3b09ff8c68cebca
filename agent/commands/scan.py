"""``precision-agent scan``: one dump directory or file, scanned by the daemon's scanner
(dumps/scan.py) and judged by the daemon's rules through a fresh pipeline; the fusion suspect of
the first bad op; the text report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..dumps.scan import Progress, scan_dump, with_fusion, with_inf_extremes
from ..engine.rulefile import RuleSet
from ..model import json_safe
from .compare import usable_cpus
from .tools import EXIT_ERRORS as EXIT_CONFIG, exit_status, progress_bar, rules_dirs, write_all


MAX_DEFAULT_JOBS = 8   # past this a tree scan is bound by memory bandwidth, not by cores


def default_jobs() -> int:
    """``scan --jobs`` unless given: the CPUs this process may use (its affinity, e.g. taskset or a
    cgroup cpuset), at most :data:`MAX_DEFAULT_JOBS`."""
    return min(MAX_DEFAULT_JOBS, usable_cpus())


def findings(result: dict[str, Any], rules: RuleSet, labels: dict[str, str] | None = None,
             ) -> list[dict[str, Any]]:
    """Judge a scan result with ``rules`` exactly as the daemon does: the same samples, the
    same detectors, a fresh pipeline."""
    from ..engine.pipeline import Pipeline
    from ..dumps.samples import result_samples
    pipeline = Pipeline(rules.fresh(), max_series=1 << 16, keep_findings=100_000)
    pipeline.process(result_samples(result, labels or {}))
    out = []
    latest = {}   # an incident kind refreshes its finding per bad step: the last one holds them all
    for f in pipeline.findings:
        if "incident" in f.evidence:
            latest[(f.rule, f.labels)] = f
    for f in pipeline.findings:
        if "incident" in f.evidence and latest[(f.rule, f.labels)] is not f:
            continue
        lab, ev = dict(f.labels), f.evidence
        rank: Any = lab.get("rank", ev.get("origin_rank") if "incident" in ev else None)
        out.append({"rule": f.rule, "kind": f.kind, "severity": f.severity, "step": f.step,
                    "rank": int(rank) if rank and rank.isdigit() else rank, "op": lab.get("op") or ev.get("op"), "tensor": ev.get("tensor"),
                    "summary": f.annotations.get("summary") or f.summary, "labels": lab, "evidence": ev})
    return out


def scan(path: Path, step: int | None = None, rules: RuleSet | None = None,
         labels: dict[str, str] | None = None, progress: Progress | None = None,
         threads: int | None = 1, fusion: Any = None, jobs: int = 1) -> dict[str, Any]:
    """``precision-agent scan``: :func:`scan_dump` plus the findings of ``rules`` (default: the
    shipped rule files), tensors shown as msprobe shows them (:func:`with_inf_extremes`).
    ``threads``: scanner threads per tensor (the daemon keeps 1; None: the jobs a tree of fewer big
    tensors than ``jobs`` leaves idle split those tensors' passes); ``jobs``: tensors scanned at
    once (the result is the same for any number). ``fusion``: the compiler's fusion
    report and executed graph (agent/fusion/context.py), to name the passes behind a first bad op."""
    if rules is None:
        from ..engine.rulefile import default_rules_dir, load_rules
        rules = load_rules([default_rules_dir()])
    r = scan_dump(path, step, progress, threads or 1, jobs=jobs, spread=threads is None)
    if fusion is not None:
        with_fusion(r, fusion)
    r["findings"] = findings(r, rules, labels)   # judged on the scanner's own statistics
    r["tensors"] = [with_inf_extremes(t) for t in r["tensors"]]
    return r


def _num(v: Any) -> str:
    """A statistic in a table cell: ±Inf and NaN as msprobe prints them (inf, -inf, nan)."""
    if v is None:
        return "-"
    if isinstance(v, str):          # already JSON-safe ("+Inf")
        return {"+Inf": "inf", "-Inf": "-inf", "NaN": "nan"}.get(v, v)
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _at(step: Any, rank: Any) -> str:
    parts = [f"{k} {v}" for k, v in (("step", step), ("rank", rank)) if v is not None]
    return f" ({', '.join(parts)})" if parts else ""


def format_report(r: dict[str, Any], limit: int = 40) -> str:
    """The text report: every name in full (the tensor column comes last, so long names never
    push the numbers out of line), steps and ranks as ``-`` where the layout has none."""
    lines = [f"path:    {r['path']}", f"layout:  {r['layout']}"
             + (f" ({', '.join(r['layouts'])})" if r.get("layouts") and r["layout"] == "mixed" else ""),
             f"tensors: {len(r['tensors'])}"]
    bad = [t for t in r["tensors"] if t["nan"] or t["pos_inf"] or t["neg_inf"]]
    lines.append(f"with NaN/Inf: {len(bad)}")
    f = r["first_nonfinite"]
    lines.append("first bad op: " + (f"{f['op']} {f['tensor']}{_at(f['step'], f['rank'])}" if f else "none"))
    if f and f.get("uncertain"):
        lines.append(f"  origin uncertain: {f.get('unreadable_before_count', 0)} tensor(s) before it could not be "
                     "read; the true first non-finite tensor may be among them:")
        lines += [f"    {u['op']} {u['tensor']}{_at(u['step'], u['rank'])}: {u['path']}: {u['reason']}"
                  for u in f.get("unreadable_before") or ()]
    fs_ = r.get("fusion_suspect")
    if fs_ and fs_.get("kind"):
        lines.append(f"fusion suspect: {fs_['op']} is a fused {fs_.get('api') or 'op'} ({fs_['kind']}): {fs_['advice']}")
    if bad:
        lines.append(f"{'step':>5} {'rank':>4} {'nan':>8} {'+inf':>8} {'-inf':>8} {'max':>12} {'min':>12}  tensor")
        for t in bad[:limit]:
            lines.append(f"{_num(t['step']):>5} {_num(t['rank']):>4} {t['nan']:>8} {t['pos_inf']:>8} {t['neg_inf']:>8}"
                         f" {_num(t['max']):>12} {_num(t['min']):>12}  {t['name']} {t['io']}[{t['index']}]")
        if len(bad) > limit:
            lines.append(f"... and {len(bad) - limit} more (use --json)")
    ovf = r.get("overflows") or []
    lines.append(f"overflows: {len(ovf)}" + (" (earliest first)" if ovf else ""))
    for o in ovf[:limit]:
        lines.append(f"  step {_num(o['step'])} rank {_num(o['rank'])}  {o['op'] or '(dump file not found)'} "
                     f"[{o['op_type'] or '?'}]  {o['accelerator']} task {o['task_id']} stream {o['stream_id']}: "
                     f"{o['status'] or 'no flag'}")
    fs = r.get("findings") or []
    lines.append(f"findings: {len(fs)}")
    for f in fs[:limit]:
        lines.append(f"  [{f['severity']}] {f['rule']}{' step ' + str(f['step']) if f['step'] is not None else ''}: "
                     f"{f['summary']}")
    for e in r["errors"][:limit]:
        lines.append(f"unreadable: {e['path']}: {e['reason']}")
    if len(r["errors"]) > limit:
        lines.append(f"... and {len(r['errors']) - limit} more unreadable (use --json)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The command: exit 0 clean, 1 findings at or above --fail-on, 2 unreadable or nothing found."""
    from ..engine.rulefile import load_rules
    path = Path(args.path)
    if not path.exists():
        print(f"precision-agent: {path}: no such file or directory", file=sys.stderr)
        return EXIT_CONFIG
    try:
        rules = load_rules(rules_dirs(args))
    except ConfigError as exc:
        print(f"precision-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if rules.errors:
        for e in rules.errors.values():
            print(f"precision-agent: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from ..fusion.context import load_context
    fusion = load_context(args.graph, args.fusion_report, root=path)
    result = scan(path, args.step, rules, progress=progress_bar(args.progress), threads=args.threads,
                  fusion=fusion, jobs=getattr(args, "jobs", None) or default_jobs())
    if args.json:
        write_all(json.dumps(json_safe(result), indent=2) + "\n")
    else:
        print(format_report(result))
    for w in result.get("warnings") or ():
        print(f"precision-agent: note: {w}", file=sys.stderr)
    if not result["tensors"] and not result["overflows"] and not result["errors"]:
        print(f"precision-agent: {path}: " + (f"no tensor at step {args.step}" if args.step is not None else
              "no dump files found (msprobe dump.json, CANN, Opdebug, MindSpore, .npy/.npz) at any depth"),
              file=sys.stderr)
        return EXIT_CONFIG
    return exit_status(result["findings"], result["errors"], args.fail_on)

