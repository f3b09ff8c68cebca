"""The ``precision-agent`` command: run, replay, scan, compare, rules check/test, demo.

Exit status: 0 success, 1 a check found problems (``scan``/``replay``: a finding at or above
``--fail-on``; see tools.py), 2 bad usage, bad configuration or unreadable input; 141 when
stdout's reader went away (``| head``), without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .. import __version__
from .tools import add_fail_on, add_rules_test_args, exit_status, progress_bar, rules_dirs, run_command
from ..errors import DEFAULT_LISTEN, ConfigError
from ..kernels.pools import limit_native_pools

# The module is what every command imports first: what it imports at its top, every one-shot
# command pays for at start (``compare`` is timed against ``cat``). So the commands' modules, and
# json/logging, are imported where they are used, and :func:`main` registers on the parser only
# the command it runs (tests/commands/test_cli_imports.py keeps that).

EXIT_OK, EXIT_PROBLEMS, EXIT_CONFIG = 0, 1, 2


def _setup_logging(level: str) -> None:
    import logging
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("watchdog").setLevel(logging.WARNING)


def _watch_arg(text: str) -> dict[str, Any]:
    """--watch PATH or --watch KIND:PATH (KIND is log or dump)."""
    kind, sep, path = text.partition(":")
    if sep and kind in ("log", "dump"):
        return {"path": path, "kind": kind}
    return {"path": text, "kind": "log"}


def cmd_run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..daemon.agent import Agent, default_state_dir
    from ..store.state import StateError
    overrides: dict[str, Any] = {"listen": args.listen, "log_level": args.log_level,
                                 "web_config_file": args.web_config_file,
                                 "watches": [_watch_arg(w) for w in args.watch] or None,
                                 "rule_dirs": args.rules or None}
    state = args.state
    if state is None and args.config is None:
        default = Path("/var/lib/precision-agent")
        state = str(default if os.access(default if default.exists() else default.parent, os.W_OK)
                    else default_state_dir())
    overrides["state_dir"] = state
    try:
        config = load_config(Path(args.config) if args.config else None, overrides)
    except ConfigError as exc:
        many = f" ({len(exc.problems)} problems)" if len(exc.problems) > 1 else ""
        print(f"precision-agent: bad configuration{many}:{chr(10) if many else ' '}{exc}", file=sys.stderr)
        return EXIT_CONFIG
    if not config.watches:
        print("precision-agent: nothing to watch: give --watch PATH or 'watches:' in the config file",
              file=sys.stderr)
        return EXIT_CONFIG
    _setup_logging(config.log_level)
    path = Path(args.config) if args.config else None
    try:
        agent = Agent(config, reread=lambda: load_config(path, overrides))
    except (StateError, ConfigError) as exc:
        print(f"precision-agent: cannot start: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:  # e.g. the listen port is taken
        print(f"precision-agent: cannot listen on {config.listen}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_CONFIG
    return agent.run_forever()


def _not_a_file(path: Path) -> str:
    """Why ``path`` cannot be replayed: what it is, when it exists but is no regular file."""
    import stat
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    what = next((name for test, name in kinds if test(mode)), "a special file")
    return f"not a regular file: it is {what} (replay reads a log file to its end)"


def cmd_replay(args: argparse.Namespace) -> int:
    from ..readers.parsers import UnknownFormat
    from .replay import format_report, replay
    from ..engine.rulefile import load_rules
    path = Path(args.file)
    if not path.is_file():
        print(f"precision-agent: {path}: {_not_a_file(path)}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        rules = load_rules(rules_dirs(args))
        if rules.errors:
            for e in rules.errors.values():
                print(f"precision-agent: {e}", file=sys.stderr)
            return EXIT_CONFIG
        result = replay(path, rules, "custom" if args.pattern and args.format == "auto" else args.format,
                        pattern=args.pattern,
                        progress=progress_bar(args.progress, verb="replaying", items="lines"),
                        warn=lambda message: print(f"precision-agent: {message}", file=sys.stderr))
    except (ConfigError, UnknownFormat) as exc:
        print(f"precision-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        print(f"precision-agent: {path}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.json:
        import json
        from ..model import json_safe
        json.dump(json_safe(result), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(result))
    blind = _unrecognized(path, result)
    return exit_status(result["findings"], blind, args.fail_on)


def _unrecognized(path: Path, result: dict[str, Any]) -> list[str]:
    """A file without a single training record: say so on stderr (the daemon's ticket
    LogFormatUnrecognized), and it counts as an error (exit 2), never as a clean replay."""
    if result["unrecognized"] is None:
        return []
    what = f"no training record recognised in {result['lines']} line(s)" if result["lines"] else "an empty file"
    print(f"precision-agent: {path}: {what}: the agent would be blind to this log "
          "(name its format with --format, or give a --pattern)", file=sys.stderr)
    sample = result["unrecognized"]["sample"]
    if sample:
        print("precision-agent: its last lines:\n" + "\n".join("  " + s for s in sample), file=sys.stderr)
    return [what]


def cmd_rules_check(args: argparse.Namespace) -> int:
    from ..engine.rulefile import load_rule_file, rule_files
    try:
        files = rule_files([Path(d) for d in args.paths] if args.paths else rules_dirs(args))
    except ConfigError as exc:
        print(f"FAILED {exc}", file=sys.stderr)
        return EXIT_PROBLEMS
    if not files:
        print("no rule files found", file=sys.stderr)
        return EXIT_PROBLEMS
    bad = 0
    for f in files:
        try:
            rules = load_rule_file(f)
        except ConfigError as exc:
            bad += 1
            print(f"FAILED {exc}")
            continue
        print(f"SUCCESS {f}: {len(rules)} rule(s)")
    return EXIT_PROBLEMS if bad else EXIT_OK


def cmd_scan(args: argparse.Namespace) -> int:
    from .scan import run  # imported on use: building the parser must stay cheap for every command
    return run(args)


def _threads(text: str) -> int:
    n = int(text) if text.isdigit() else 0
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of threads from 1 to 64")
    return n


def cmd_rules_test(args: argparse.Namespace) -> int:
    from .ruletest import run  # imported on use: building the parser must stay cheap for every command
    return run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(duration=args.duration, listen=args.listen)


def _add_run(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run the agent (the resident daemon)")
    r.add_argument("--config", "-c", help="YAML config file")
    r.add_argument("--watch", action="append", default=[], metavar="[log:|dump:]PATH",
                   help="a log file or directory to watch (repeatable; adds to the config's watches)")
    r.add_argument("--listen", help=f"HOST:PORT for /metrics and the API (default {DEFAULT_LISTEN})")
    r.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="exporter-toolkit web config (TLS, basic auth) for /metrics and the API")
    r.add_argument("--state", help="state directory (offsets, alerts)")
    r.add_argument("--rules", action="append", metavar="DIR", help="extra rule directory (repeatable)")
    r.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    r.set_defaults(func=cmd_run)


def _add_replay(sub: argparse._SubParsersAction) -> None:
    rp = sub.add_parser("replay", help="run a finished log through the parsers and rules")
    rp.add_argument("file")
    rp.add_argument("--json", action="store_true", help="print one JSON object")
    rp.add_argument("--format", default="auto", help="log format (default: detect)")
    rp.add_argument("--pattern", help="a user-defined format: a regex with named groups (step, loss, grad_norm, "
                                      "loss_scale, lr, eval_loss, overflow, nonfinite)")
    rp.add_argument("--rules", action="append", metavar="DIR", help="rule directory (default: shipped rules)")
    rp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress (bytes and lines read) on stderr (default: when stderr is a terminal)")
    add_fail_on(rp)
    rp.set_defaults(func=cmd_replay)


def _add_scan(sub: argparse._SubParsersAction) -> None:
    sc = sub.add_parser("scan", help="scan tensor dumps: per-tensor statistics and the first bad op")
    sc.add_argument("path", help="a dump directory (msprobe, CANN, MindSpore, .npy/.npz tree) or file")
    sc.add_argument("--json", action="store_true", help="print one JSON object")
    sc.add_argument("--step", type=int, default=None, help="only this step")
    sc.add_argument("--rules", action="append", metavar="DIR", help="rule directory (default: shipped rules)")
    sc.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar on stderr (default: when stderr is a terminal)")
    sc.add_argument("--threads", type=_threads, default=None, metavar="N",
                    help="scanner threads per tensor (default: 1, or the jobs left idle where fewer big tensors "
                         "than --jobs are left to scan, e.g. one big file; the daemon always uses 1)")
    sc.add_argument("--jobs", "-j", type=_threads, default=None, metavar="N",
                    help="tensors (files) scanned at once (default: the CPUs this process may use, at most 8; "
                         "1 scans one after the other); the output is the same for any N")
    sc.add_argument("--graph", metavar="FILE", help="the executed GE graph (ATC JSON or ge_proto_*_Build.txt; "
                    "default: the newest ge_proto_*_Build.txt under PATH), to name the fusion passes of a bad op")
    sc.add_argument("--fusion-report", action="append", metavar="FILE",
                    help="fusion_result.json (default: the newest fusion_result*.json under PATH)")
    add_fail_on(sc)
    sc.set_defaults(func=cmd_scan)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    from .compare import add_parser
    add_parser(sub)


def _add_fusion(sub: argparse._SubParsersAction) -> None:
    from .fusion import add_parser
    add_parser(sub)


def _add_rules(sub: argparse._SubParsersAction) -> None:
    ru = sub.add_parser("rules", help="rule-file tools")
    rsub = ru.add_subparsers(dest="rules_command", metavar="SUBCOMMAND")
    rc = rsub.add_parser("check", help="validate rule files")
    rc.add_argument("paths", nargs="*", help="rule files or directories (default: the shipped rules)")
    rc.set_defaults(func=cmd_rules_check, rules=None)
    rt = rsub.add_parser("test", help="unit-test rule files (like promtool test rules)")
    add_rules_test_args(rt)
    rt.set_defaults(func=cmd_rules_test, rules=None)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="start the agent on a simulated training job and show alerts firing")
    d.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: Ctrl-C)")
    d.add_argument("--listen", default=None, help=f"HOST:PORT (default {DEFAULT_LISTEN}, or a free port)")
    d.set_defaults(func=cmd_demo)


COMMANDS = {"run": _add_run, "replay": _add_replay, "scan": _add_scan, "compare": _add_compare,
            "fusion": _add_fusion, "rules": _add_rules, "demo": _add_demo}   # in the order --help lists them


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, its width found without ``shutil`` (whose import, with bz2's and
    lzma's, argparse pays on the first add_argument of every command: ~5-10 ms of a one-shot
    command's start), as shutil.get_terminal_size finds it: $COLUMNS, else stdout's terminal,
    else 80 columns."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        if width is None:
            width = _columns() - 2
        super().__init__(prog, indent_increment, max_help_position, width)


def _columns() -> int:
    try:
        cols = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        cols = 0
    if cols <= 0:
        try:
            cols = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            cols = 0
    return cols if cols > 0 else 80


class _Parser(argparse.ArgumentParser):
    """ArgumentParser with :class:`_Formatter` by default (its subcommands' parsers are of this
    class too: add_subparsers makes them of the parser's own type)."""

    def __init__(self, *args: Any, formatter_class: type = _Formatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``only``: with that command alone (what :func:`main` runs:
    each command's options are built, and its module imported, only for that command), every
    command when None or when it is not one (then the usage names them all)."""
    p = _Parser(prog="precision-agent", description="Watch training logs and dumps for numerical-precision failures.")
    p.add_argument("--version", action="version", version=f"precision-agent {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, add in COMMANDS.items():
        if only not in COMMANDS or name == only:
            add(sub)
    return p


def command_of(argv: list[str]) -> str | None:
    """The command ``argv`` runs when it is its first word (an option before it, ``--help`` or
    ``--version``, needs the whole parser): None otherwise."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    limit_native_pools()   # before anything imports numpy: no command needs BLAS's or OpenMP's threads
    entry, argv = argv is None, sys.argv[1:] if argv is None else argv   # entry: the process's own
    parser = build_parser(command_of(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CONFIG
    status = run_command(args.func, args)
    if entry and getattr(args, "exit_at_once", False):
        from .tools import exit_at_once
        return exit_at_once(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
