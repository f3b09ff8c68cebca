"""``precision-agent fusion passes|graph|bisect|ab``: a thin front end over report, graph, switch, bisect
and the ``ab`` rule kind's verdict.

Exit status: 0 success, 2 bad usage or a file that cannot be read (the reason on stderr); ``ab``:
1 when the fusion-on run is clearly worse, 2 with too few common steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..detectors.ab import AbParams

EXIT_OK, EXIT_USAGE = 0, 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``fusion`` and its subcommands on the main parser."""
    f = subparsers.add_parser("fusion", help="fusion reports, executed graphs, and bisection to the fusion pass")
    fsub = f.add_subparsers(dest="fusion_command", metavar="SUBCOMMAND")
    f.set_defaults(func=lambda args: _usage(f))

    p = fsub.add_parser("passes", help="the passes of fusion_result.json files: effective and matched only")
    p.add_argument("files", nargs="+", metavar="FILE", help="fusion_result.json (any shape; several are merged)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_passes)

    g = fsub.add_parser("graph", help="the executed GE graph (ATC JSON or ge_proto_*_Build.txt): "
                                      "per op its type, fusion passes and original ops")
    g.add_argument("file", metavar="FILE")
    g.add_argument("--op", metavar="NAME", help="only this op (or the ops that merged an original op of this name)")
    g.add_argument("--fused", action="store_true", help="only fused ops")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_graph)

    b = fsub.add_parser("bisect", help="find the fusion pass that breaks a run in ceil(log2 N) runs")
    b.add_argument("--passes", metavar="FILE", help="fusion_result.json of the bad run (needed to start a session)")
    b.add_argument("--session", required=True, metavar="FILE", help="session file (JSON; created on first use)")
    b.add_argument("--result", choices=("good", "bad"),
                   help="outcome of the run made with the current switch file: good = healthy")
    b.add_argument("--from-ab", nargs=2, metavar=("ROUND.log", "OFF.log"),
                   help="take the result from the ab verdict of the log of the run made with the current switch "
                        "file against the log of the run with all fusion off: clearly worse = bad, else good")
    b.add_argument("--format", default="auto", help="with --from-ab: log format of both files (default: detected)")
    _ab_options(b, "with --from-ab: ")
    b.add_argument("--cfg", metavar="PATH",
                   help="where to write fusion_switch.cfg (default: fusion_switch.cfg beside the session file)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=cmd_bisect)

    a = fsub.add_parser("ab", help="is the fusion-on run clearly worse than the fusion-off run? "
                                   "(the verdict of the rule kind ab on two logs)")
    a.add_argument("on", metavar="ON.log", help="the log of the run with fusion on (the suspect)")
    a.add_argument("off", metavar="OFF.log", help="the log of the run with fusion off (the reference)")
    a.add_argument("--format", default="auto", help="log format of both files (default: detected)")
    _ab_options(a)
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(func=cmd_ab)


def _ab_options(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The ab verdict's parameters; default: those of the shipped FusionSuspected rule (rules/fusion.yml)."""
    p.add_argument("--window", type=int, help=f"{prefix}each of the two halves of common steps compared "
                                               "(default: the shipped rule's, 50)")
    p.add_argument("--min-steps", type=int, help=f"{prefix}common steps needed for a verdict on the loss gap "
                                                  "(default: the shipped rule's, 20)")
    p.add_argument("--alpha", type=float, help=f"{prefix}sign-test significance in each half "
                                               "(default: the shipped rule's, 0.01)")
    p.add_argument("--min-gap", type=float, help=f"{prefix}relative median loss gap that counts "
                                                 "(default: the shipped rule's, 0.02)")


def _ab_params(args: argparse.Namespace) -> "tuple[AbParams | None, str]":
    """(AbParams, "") or (None, why): the shipped rule's parameters with the options given."""
    from pydantic import ValidationError
    from ..config import ConfigError
    from .ab import shipped_params
    try:
        return shipped_params(window=args.window, min_steps=args.min_steps, alpha=args.alpha,
                              min_gap=args.min_gap), ""
    except ValidationError as exc:
        return None, f"{exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}"
    except ConfigError as exc:
        return None, f"the shipped rule file: {exc}"


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _fail(msg: str) -> int:
    print(f"precision-agent: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _dump(doc: object) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def cmd_passes(args: argparse.Namespace) -> int:
    from ..fusion.report import FusionReportError, format_report, load_reports, report_json
    try:
        report = load_reports(args.files)
    except FusionReportError as exc:
        return _fail(f"bad fusion report: {exc}")
    if args.json:
        _dump(report_json(report))
    else:
        print(format_report(report))
    return EXIT_OK


def cmd_graph(args: argparse.Namespace) -> int:
    from ..fusion.graph import GraphFormatError, format_graph, read_graph_file
    try:
        g = read_graph_file(args.file)
    except GraphFormatError as exc:
        return _fail(f"bad graph file: {exc}")
    ops = g.ops
    if args.op:
        ops = g.find(args.op)
        if not ops:
            return _fail(f"{args.file}: no op named {args.op!r} (nor one merging an original op of that name)")
    if args.fused:
        ops = [o for o in ops if o.fused]
    if args.json:
        doc = g.to_json()
        doc["op_list"] = [o.to_json() for o in ops]
        _dump(doc)
    else:
        print(format_graph(g, ops))
    return EXIT_OK


def cmd_bisect(args: argparse.Namespace) -> int:
    from ..fusion.bisect import BisectError, BisectSession, load_session, locked, save_session
    from ..fusion.report import FusionReportError, load_reports
    from ..fusion.switch import write_switch
    session = Path(args.session)
    cfg = Path(args.cfg) if args.cfg else session.parent / "fusion_switch.cfg"
    if not session.parent.is_dir():
        return _fail(f"{session}: its folder does not exist")
    ab = None
    if args.from_ab:
        if args.result:
            return _fail("fusion bisect: give --result or --from-ab, not both")
        args.result, ab, why = _result_from_ab(args)
        if args.result is None:
            return _fail(why)
    try:
        with locked(session):
            if session.exists():
                s = load_session(session)
                if args.passes:
                    report = load_reports([args.passes])
                    if tuple(report.effective) != s.candidates:
                        return _fail(f"{args.passes}: its effective passes differ from those the session "
                                     f"{session} started with; use a new session file")
                if args.result:
                    s.record(args.result)
                    save_session(session, s)
            else:
                if not args.passes:
                    return _fail(f"{session}: no such session; give --passes fusion_result.json to start one")
                if args.result:
                    return _fail(f"{session}: new session: there is no round to record a result for yet; "
                                 f"run without --result first, then train with the switch file it writes")
                report = load_reports([args.passes])
                s = BisectSession.start([args.passes], report.effective,
                                        {p: report.kinds(p) for p in report.effective})
                save_session(session, s)
            write_switch(cfg, s.switch_cfg())
    except FusionReportError as exc:
        return _fail(f"bad fusion report: {exc}")
    except BisectError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"{exc.filename or session}: {exc.strerror or exc}")
    doc = s.to_json(str(cfg))
    if ab is not None:
        doc["from_ab"] = ab
    if args.json:
        _dump(doc)
    else:
        if ab is not None:
            print(f"ab verdict of {ab['round_log']} against {ab['off_log']}: {ab['verdict']} over "
                  f"{ab['steps_compared']} common steps: recorded {ab['result']}")
        print(doc["message"])
        if not s.done or s.status == "found":
            print(f"remaining ({len(s.remaining)}): {', '.join(s.remaining)}")
    return EXIT_OK


def _result_from_ab(args: argparse.Namespace) -> tuple[str | None, dict | None, str]:
    """(good | bad | None, what the ab verdict said, why there is no result)."""
    from ..readers.parsers import UnknownFormat
    from .ab import round_result
    round_log, off_log = map(Path, args.from_ab)
    params, why = _ab_params(args)
    if params is None:
        return None, None, f"fusion bisect --from-ab: {why}"
    for path in (round_log, off_log):
        if not path.is_file():
            return None, None, f"fusion bisect --from-ab: {path}: not a readable file"
    try:
        result, r = round_result(round_log, off_log, params, fmt=args.format)
    except (OSError, UnknownFormat) as exc:
        return None, None, f"fusion bisect --from-ab: {exc}"
    if result is None:
        return None, None, (f"fusion bisect --from-ab: {r.verdict} ({r.steps_compared} common steps of "
                            f"{round_log} and {off_log}): train longer, or give --result good|bad by hand")
    return result, {"round_log": str(round_log), "off_log": str(off_log), "verdict": r.verdict,
                    "steps_compared": r.steps_compared, "evidence": r.evidence, "result": result}, ""


def cmd_ab(args: argparse.Namespace) -> int:
    """Exit 0: no_difference or fusion_off_worse; 1: fusion_suspected; 2: insufficient_data or a bad file."""
    from ..readers.parsers import UnknownFormat
    from .ab import compare_logs
    params, why = _ab_params(args)
    if params is None:
        return _fail(f"fusion ab: {why}")
    for path in (args.on, args.off):
        if not Path(path).is_file():
            return _fail(f"fusion ab: {path}: not a readable file")
    try:
        result = compare_logs(Path(args.on), Path(args.off), params, args.format)
    except (OSError, UnknownFormat) as exc:
        return _fail(f"fusion ab: {exc}")
    doc = result.to_json()
    if args.json:
        _dump(doc)
    else:
        print(f"verdict:        {result.verdict}")
        print(f"steps compared: {result.steps_compared}")
        for k, v in result.evidence.items():
            print(f"  {k}: {v}")
    return {"fusion_suspected": 1, "insufficient_data": 2}.get(result.verdict, EXIT_OK)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m precision_agent.commands.fusion fusion ...``."""
    parser = argparse.ArgumentParser(prog="precision-agent")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
