"""``precision-agent compare BENCH TARGET``: compare a run's dumps with a benchmark run or a rerun.

Exit status (as the other commands): 0 no divergence under the preset, 1 divergence (or, with
``--rerun``, any bit that differs), 2 bad usage or nothing readable to compare (a missing path, a
side with no tensors, no pair at all, a CSV that cannot be written); unreadable files among
readable ones are listed and give 2 only when nothing diverged; 141 when stdout's reader went
away (``| head``), quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..model import gc_paused, json_safe
from ..compare.verdict import PRESETS

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE = 0, 1, 2
# Past a few threads a compare gains nothing and pays for each one: the pairs' Python (reading the
# .pt's zip and pickle, the verdict) holds the GIL for about half of a small tensor's compare, and
# large tensors are bound by memory bandwidth, as scan's are. On the 16-core host 16 threads were
# no faster than 1 on the msprobe bench (0.297 vs 0.281 s), and each thread beyond the free cores
# costs CPU (bench/README, compare_msprobe).
MAX_DEFAULT_JOBS = 8


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``compare`` on the main parser's subcommands."""
    c = subparsers.add_parser("compare", help="compare dumps with a benchmark run or a rerun; name the "
                                               "first op that lost precision")
    c.add_argument("bench", help="the benchmark (golden) dump tree: GPU/CPU run, or the first run with --rerun")
    c.add_argument("target", help="the dump tree under test (e.g. the NPU run)")
    c.add_argument("--preset", choices=PRESETS, default="strict",
                   help="verdict rule (default strict: first op whose inputs match but an output does not)")
    c.add_argument("--rerun", action="store_true",
                   help="the two trees are two runs of one configuration: any differing bit is nondeterminism")
    c.add_argument("--csv", metavar="OUT", help="write the full table as CSV to OUT")
    c.add_argument("--csv-layout", choices=("msaccucmp", "msprobe"), default="msaccucmp",
                   help="CSV columns (default msaccucmp's)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--step", type=int, default=None, help="only this step")
    c.add_argument("--rank", type=int, default=None, help="only this rank")
    c.add_argument("--graph", metavar="FILE",
                   help="the fusion-on run's executed graph (ATC JSON or ge_proto_*_Build.txt; default: the newest "
                        "ge_proto_*_Build.txt in either tree): pairs a fusion-on graph dump with a fusion-off one "
                        "and names the passes of a fused op")
    c.add_argument("--fusion-report", action="append", metavar="FILE",
                   help="fusion_result.json (default: the newest fusion_result*.json in the tree of the graph)")
    c.add_argument("--jobs", type=_jobs, default=None, metavar="N",
                   help=f"pairs compared at once (default: the CPUs this process may use, at most {MAX_DEFAULT_JOBS}; "
                        "1: one thread); the results are the same for any N")
    c.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    c.set_defaults(func=run, exit_at_once=True)   # cli.main: no interpreter teardown after the report


def run(args: argparse.Namespace) -> int:
    # numpy is first imported below, after cli.main bounded BLAS's threads (kernels/pools.py): the
    # compare's dots stay under OpenBLAS's threading size (blocks.py), so its pool would only cost
    # start-up and spinning (~60 ms of a 0.35 s compare of a 90 MB dump pair)
    with gc_paused():   # numpy's import and ours: objects, no garbage, yet ~30 collections of a growing heap
        from .tools import progress_bar   # the one scan uses
        from ..compare.engine import compare_sides
        from ..compare.pairing import read_side
        from ..compare.report import format_text, to_json, write_csv
    try:
        bench, target = read_side(args.bench), read_side(args.target)
    except FileNotFoundError as exc:
        print(f"precision-agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for name, side in (("benchmark", bench), ("target", target)):
        if not side.tensors:
            why = "; ".join(f"{p}: {r}" for p, r in side.errors[:3]) or "no dump files found"
            print(f"precision-agent: {name} {side.path}: no tensors to compare ({why})", file=sys.stderr)
            return EXIT_USAGE
    from ..fusion.context import context_for
    fusion = context_for(args.graph, args.fusion_report, [args.target, args.bench])
    res = compare_sides(target, bench, preset=args.preset, rerun=args.rerun, step=args.step, rank=args.rank,
                        progress=progress_bar(args.progress, verb="comparing", items="pairs"), fusion=fusion,
                        jobs=args.jobs or default_jobs())
    res.target.errors += [("fusion", e) for e in fusion.errors]
    for w in fusion.warnings:   # a bounded search cut short: a note, not an unreadable file
        print(f"precision-agent: note: {w}", file=sys.stderr)
    if args.csv:
        try:
            with open(args.csv, "w", newline="", encoding="utf-8") as fh:
                write_csv(res, fh, args.csv_layout)
        except OSError as exc:
            print(f"precision-agent: cannot write {args.csv}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE
    if args.json:
        write_json(json_safe(to_json(res)), sys.stdout)
    else:
        print(format_text(res))
    if not res.rows:
        print("precision-agent: nothing was paired between the two trees", file=sys.stderr)
        return EXIT_USAGE
    if res.diverged:
        return EXIT_DIVERGED
    return EXIT_USAGE if res.errors else EXIT_OK


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def default_jobs() -> int:
    """``--jobs`` unless given: the CPUs this process may use, at most :data:`MAX_DEFAULT_JOBS`."""
    return min(MAX_DEFAULT_JOBS, usable_cpus())


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as ``taskset``/cgroups cpusets set it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def write_json(doc: dict, fh) -> None:
    """One key per line and one row per line: readable, and each value goes through json's C
    encoder (``indent`` selects the pure-Python one: ~50 ms for a few hundred rows)."""
    lines = []
    for k, v in doc.items():
        if isinstance(v, list) and v:
            inner = ",\n".join("    " + json.dumps(item) for item in v)
            lines.append(f"  {json.dumps(k)}: [\n{inner}\n  ]")
        else:
            lines.append(f"  {json.dumps(k)}: {json.dumps(v)}")
    fh.write("{\n" + ",\n".join(lines) + "\n}\n")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m precision_agent.commands.compare``) until the main CLI wires it."""
    parser = argparse.ArgumentParser(prog="precision-agent")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    from .tools import run_quietly_on_closed_pipe
    return run_quietly_on_closed_pipe(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
