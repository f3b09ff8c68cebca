"""What every one-shot command shares: the progress bar, the exit status of a report, and a
quiet end when the reader of stdout goes away (``precision-agent scan ... | head``).

Exit status of ``scan`` and ``replay`` (``compare`` has the same shape, see compare.py):
0 clean, 1 findings at or above ``--fail-on`` (default ``page``: the rules' page and critical
findings; ``--fail-on info`` makes any finding count), 2 errors: bad usage, nothing readable,
or unreadable files/lines when no finding reached ``--fail-on``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from ..model import SEVERITIES  # ordered, lowest first

EXIT_OK, EXIT_FINDINGS, EXIT_ERRORS = 0, 1, 2
EXIT_PIPE = 141                  # 128 + SIGPIPE: what a shell reports for `yes | head`
DEFAULT_FAIL_ON = "page"


def add_fail_on(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fail-on", choices=SEVERITIES, default=DEFAULT_FAIL_ON, metavar="SEVERITY",
                   help="exit 1 when a finding has this severity or a higher one (default page; "
                        f"one of {', '.join(SEVERITIES)})")


def failing(findings: Iterable[dict[str, Any]], fail_on: str) -> list[dict[str, Any]]:
    """The findings at or above ``fail_on`` (an unknown severity counts as failing)."""
    floor = SEVERITIES.index(fail_on)
    return [f for f in findings
            if f.get("severity") not in SEVERITIES or SEVERITIES.index(f["severity"]) >= floor]


def exit_status(findings: Iterable[dict[str, Any]], errors: Iterable[Any], fail_on: str) -> int:
    """1 when a finding reaches ``fail_on``, else 2 when anything could not be read, else 0."""
    if failing(findings, fail_on):
        return EXIT_FINDINGS
    return EXIT_ERRORS if any(True for _ in errors) else EXIT_OK


def add_rules_test_args(p: argparse.ArgumentParser) -> None:
    """The arguments of ``rules test`` (``precision-agent rules test`` and ``python -m
    precision_agent.commands.ruletest test`` are the same command)."""
    p.add_argument("files", nargs="+", help="test files (YAML; see docs/rules-testing.md)")
    p.add_argument("--run", metavar="REGEX", help="only the tests whose name matches this regex (RE2 syntax, searched)")


def write_all(text: str) -> None:
    """``text`` to stdout in as few writes as it takes (``json.dump`` writes each token apart:
    thousands of system calls under ``PYTHONUNBUFFERED``), every byte or an error: where stdout
    is unbuffered, a write to a pipe whose reader went away can be cut short without one, so the
    rest is written until the pipe says so (``BrokenPipeError``: exit 141, see below)."""
    sys.stdout.flush()
    out = getattr(sys.stdout, "buffer", None)
    if out is None:   # pragma: no cover - a text-only stream (tests replacing stdout)
        sys.stdout.write(text)
        return
    data = memoryview(text.encode(sys.stdout.encoding or "utf-8", sys.stdout.errors or "strict"))
    while data:
        n = out.write(data)
        if n is None:   # a non-blocking stdout that is full: wait until it takes more
            import select
            select.select([], [out], [], 1.0)
            continue
        data = data[n:]


def freeze_at_exit() -> None:
    """At the interpreter's exit, before its last collections: every object left is moved out of
    the garbage collector's sight (``gc.freeze``). Those collections walked every object the
    imports made (numpy, pydantic, the rules) for nothing, as the process ends anyway: ~0.1 s of
    each command's 0.6 s on the 2-vCPU host (bench/README ``scantree``). Exit handlers still run;
    only garbage cycles are left uncollected, to the process's end. Registered once per process."""
    if not _FROZEN_AT_EXIT:
        import atexit
        import gc
        atexit.register(gc.freeze)
        _FROZEN_AT_EXIT.append(True)


_FROZEN_AT_EXIT: list[bool] = []


def run_command(func, args: argparse.Namespace) -> int:
    """Run a parsed command: a bad ``PRECISION_AGENT_KERNELS`` fails every command at start (2),
    not mid-scan; a closed stdout ends it quietly; the exit skips collecting (:func:`freeze_at_exit`)."""
    freeze_at_exit()
    from .. import kernels
    try:
        kernels.check()
    except kernels.KernelError as exc:
        print(f"precision-agent: bad environment: {exc}", file=sys.stderr)
        return EXIT_ERRORS
    return run_quietly_on_closed_pipe(func, args)


def run_quietly_on_closed_pipe(func, *args: Any) -> int:
    """Run a command; when stdout's reader has gone (``| head``), end with 141 and no traceback.

    Python's own recipe: flush inside the guard, and point stdout at /dev/null so that the
    interpreter's final flush has nowhere to fail."""
    try:
        status = func(*args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        _to_devnull(sys.stdout)
        try:                            # `2>&1 | head`: stderr may be the same closed pipe
            sys.stderr.flush()
        except (OSError, ValueError):
            _to_devnull(sys.stderr)
        return EXIT_PIPE


def exit_at_once(status: int) -> int:
    """End a finished one-shot command's process now, with ``status``: its output flushed, and
    the interpreter's teardown (clearing every module, numpy's included, and the collections it
    runs: ~40 ms of a 0.3 s ``compare``) skipped, as nothing is left to release that the kernel
    does not release. Only for the process's own entry (never for a caller of ``main(argv)``),
    after the command's threads are joined; no atexit hook of the agent's runs in a one-shot
    command. When a flush fails, returns ``status`` and the interpreter ends as before (it
    reports the failure)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return status
    os._exit(status)


def _to_devnull(stream: Any) -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):   # pragma: no cover - a stream without a descriptor
        pass


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class ProgressBar:
    """A plain-text progress bar on stderr, redrawn at most every 0.2 s; nothing for quick runs
    unless forced. Counted in bytes (``done``/``total``), with the items (tensors, pairs, lines)
    alongside; when there are no bytes to count (statistics-only dumps) the items fill the bar."""

    def __init__(self, forced: bool, width: int = 30, verb: str = "scanning", items: str = "tensors") -> None:
        self._clock = time.monotonic
        self.forced, self.width, self.verb, self.items = forced, width, verb, items
        self.start = self._clock()
        self.last = 0.0
        self.drawn = self.closed = False

    def __call__(self, done: int, total: int, items_done: int | None = None,
                 items_total: int | None = None) -> None:
        if self.closed:
            return
        now = self._clock()
        finished = done >= total if items_total is None else (done >= total and items_done == items_total)
        if not finished and (now - self.last < 0.2 or (not self.forced and now - self.start < 0.5)):
            return
        if finished and not (self.forced or self.drawn):
            return
        self.last, self.drawn, self.closed = now, True, finished
        if total > 0:
            frac, text = done / total, f"{human_bytes(done)}/{human_bytes(total)}"
        else:
            frac, text = (items_done or 0) / max(items_total or 0, 1), ""
        if items_done is not None:
            count = f"{items_done}/{items_total}" if items_total is not None else f"{items_done}"
            text = ", ".join(s for s in (text, f"{count} {self.items}") if s)
        filled = min(self.width, int(self.width * frac))
        sys.stderr.write(f"\r{self.verb} [{'#' * filled}{'.' * (self.width - filled)}] {text}"
                         + ("\n" if finished else ""))
        sys.stderr.flush()


def progress_bar(flag: bool | None, **kw: Any) -> ProgressBar | None:
    """``--progress`` forces the bar, ``--no-progress`` hides it, default: when stderr is a tty."""
    show = flag or (flag is None and sys.stderr.isatty())
    return ProgressBar(flag is True, **kw) if show else None


def rules_dirs(args: argparse.Namespace) -> list[Path]:
    """``--rules DIR`` as given, else the shipped rule files."""
    from ..engine.rulefile import default_rules_dir
    dirs = [Path(d) for d in (args.rules or [])]
    return dirs if dirs else [default_rules_dir()]
