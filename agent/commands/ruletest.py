"""``precision-agent rules test``: unit tests for rule files, in the spirit of ``promtool test rules``.

A test file names rule files, feeds log lines (through the real parsers, one appended line at a
time as the daemon tails them) and/or typed samples into the one :class:`~.pipeline.Pipeline`
under a simulated clock, evaluates every ``evaluation_interval`` as the daemon's worker does
(``expire`` then ``tick``), and compares the *firing* alerts of a rule at given times with the
expected ones. There is no second rule evaluator here: only inputs, a clock and a comparison.

Exit status: 0 all tests pass, 1 a test failed, 2 a test file (or a rule file it names) is bad.
Format and semantics: docs/rules-testing.md.
"""

from __future__ import annotations

import argparse
import glob
import sys
import tempfile
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..config import Config, ConfigError, load_yaml_mapping
from ..config.regex import UserRegex
from ..config.ruletest import AlertRuleTest, ExpectedAlert, RuleTest, RuleTestFile
from ..model import AlertState, Sample, SourcePos, make_labels
from ..engine.suspect import SUSPECT
from ..engine.pipeline import Pipeline
from ..readers.logstream import LogStream
from ..engine.rulefile import RuleSet, default_rules_dir, load_rule_file, rule_files
from .tools import add_rules_test_args, run_command

EXIT_OK, EXIT_FAILED, EXIT_BAD_FILE = 0, 1, 2
T0 = 1_700_000_000.0      # the simulated clock's zero: an ordinary epoch time, never "unset" (0)
MAX_EVALUATIONS = 200_000  # per test: bounds the run time of a test with a far eval_time
SERIES_TTL = float(Config.model_fields["series_ttl"].default)


@dataclass
class Outcome:
    name: str
    problems: list[str] = field(default_factory=list)  # empty: passed


# -- loading -------------------------------------------------------------------------------------
def _where(data: Any, loc: tuple[Any, ...]) -> str:
    """pydantic's location, with the test's name: 'test "x" field alert_rule_test.0.eval_time'."""
    parts = [str(p) for p in loc]
    if len(loc) >= 2 and loc[0] == "tests" and isinstance(loc[1], int):
        try:
            name = data["tests"][loc[1]]["name"]
            return f'test "{name}" (tests.{loc[1]}) field ' + (".".join(parts[2:]) or "(test)")
        except (KeyError, IndexError, TypeError):
            pass
    return "field " + (".".join(parts) or "(top level)")


def load_test_file(path: Path) -> RuleTestFile:
    data = load_yaml_mapping(path)
    try:
        return RuleTestFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(str(path), _where(data, first["loc"]), first["msg"].removeprefix("Value error, ")) from exc


def load_rules_for(path: Path, tf: RuleTestFile) -> RuleSet:
    """The rule files a test file names; any bad or missing one is a ConfigError (exit 2)."""
    if tf.rule_files is None:
        files = rule_files([default_rules_dir()])
    else:
        files = []
        for i, entry in enumerate(tf.rule_files):
            pattern = str(path.parent / entry)
            found = sorted(glob.glob(pattern)) if glob.has_magic(entry) else [pattern]
            try:
                exists = all(Path(f).exists() for f in found)
            except OSError as exc:  # e.g. a name too long for the file system
                raise ConfigError(str(path), f"field rule_files.{i}", f"{entry!r}: {exc.strerror or exc}") from None
            if not found or not exists:
                raise ConfigError(str(path), f"field rule_files.{i}", f"{entry!r} matches no file")
            files += rule_files([Path(f) for f in found])
    rs = RuleSet()
    for f in files:
        try:
            rs.by_file[str(f)] = load_rule_file(f)
        except ConfigError as exc:
            raise ConfigError(str(path), "rule file", str(exc)) from exc
    rs.reindex()
    for i, t in enumerate(tf.tests):
        def bad(where: str, reason: str) -> ConfigError:
            return ConfigError(str(path), f'test "{t.name}" (tests.{i}) field {where}', reason)
        for j, d in enumerate(t.dumps):
            if not (path.parent / d.path).exists():
                raise bad(f"dumps.{j}.path", f"{d.path!r} does not exist")
        for j, a in enumerate(t.alert_rule_test):
            if not rs.rule(a.alertname):
                raise bad(f"alert_rule_test.{j}.alertname", f"no rule named {a.alertname!r} in the rule files")
        evaluations = max(a.eval_time for a in t.alert_rule_test) / tf.evaluation_interval
        if evaluations > MAX_EVALUATIONS:
            raise bad("alert_rule_test", f"{evaluations:.0f} evaluations up to the last eval_time (at most "
                      f"{MAX_EVALUATIONS}): raise evaluation_interval")
    return rs


# -- running -------------------------------------------------------------------------------------
def _ms(seconds: float) -> int:
    return round(seconds * 1000)


class _Run:
    """One test: the pipeline, the simulated clock, the evaluations due so far, the log being tailed."""

    def __init__(self, rules: RuleSet, eval_ms: int, log_name: str) -> None:
        self.pipeline = Pipeline(rules.fresh(), max_series=4096)
        self.eval_ms, self.next_eval, self.log_name = eval_ms, 0, log_name
        self.stream: LogStream | None = None
        self.log: Any = None               # the file the stream tails, opened for appending
        self.errors: list[str] = []

    def evaluate_until(self, ms: int, inclusive: bool) -> None:
        """Every evaluation up to ``ms``; at the same instant, input is read before evaluating."""
        while self.next_eval < ms or (inclusive and self.next_eval == ms):
            now = T0 + self.next_eval / 1000
            self.pipeline.expire(now, SERIES_TTL)
            self.pipeline.tick(now)
            self.next_eval += self.eval_ms
            self._drain()

    def feed(self, ms: int, items: list[Any]) -> None:
        """The inputs of one instant: log lines are appended and tailed, samples passed on."""
        self.evaluate_until(ms, inclusive=False)
        batch: list[Sample] = []
        if self.stream is not None and (lines := [x for x in items if isinstance(x, str)]):
            self.log.write("".join(line + "\n" for line in lines))
            self.log.flush()
            batch = self.stream.poll(now=T0 + ms / 1000)
            for smp in batch:  # {{ $file }} renders log_name, not a temporary path
                smp.source = SourcePos(self.log_name, smp.source.line, smp.source.offset)
            self.errors += self.stream.parser.errors
            self.stream.parser.errors.clear()
        self.pipeline.process(batch + [x for x in items if isinstance(x, Sample)])
        self._drain()

    def _drain(self) -> None:
        self.errors += self.pipeline.errors
        self.pipeline.errors.clear()

    def alerts(self, name: str, state: AlertState) -> list[tuple[dict[str, str], dict[str, str]]]:
        found = [(dict(a.labels), dict(a.annotations)) for a in self.pipeline.alerts.alerts.values()
                 if a.rule == name and a.state == state]
        return sorted(found, key=lambda la: sorted(la[0].items()))


def _sample_inputs(t: RuleTest, step_ms: int) -> list[tuple[int, int, Any]]:
    out = []
    for i, s in enumerate(t.input_samples):
        at = _ms(s.at) if s.at is not None else i * step_ms
        sample = Sample(make_labels(t.labels | s.labels), s.metric, s.value, s.step, SourcePos("input_samples", i + 1),
                        T0 + at / 1000, None, tuple(s.attrs.items()))
        out.append((at, 1, sample))
    return out


def _dump_inputs(t: RuleTest, base: Path, errors: list[str]) -> list[tuple[int, int, Any]]:
    """Scan each dump now (it is complete) and hand its samples over at ``at``, as the daemon's
    dump flow does: the scan result's samples under the watch's labels."""
    if not t.dumps:
        return []
    from ..dumps.scan import scan_dump
    from ..dumps.samples import labelled, result_samples
    out: list[tuple[int, int, Any]] = []
    for d in t.dumps:
        result = scan_dump(base / d.path, d.step)
        errors += [f"dump {d.path}: {e['path']}: {e['reason']}" for e in result["errors"]]
        samples = labelled(result_samples(result, {}, d.path), t.labels)
        for s in samples:
            s.time = T0 + d.at
            out.append((_ms(d.at), 2, s))
    return out


def run_test(t: RuleTest, rules: RuleSet, evaluation_interval: float, base: Path = Path(".")) -> Outcome:
    """Feed the test's inputs in time order, evaluating on the way, and check each eval_time."""
    step_ms = _ms(t.interval if t.interval is not None else evaluation_interval)
    run = _Run(rules, max(1, _ms(evaluation_interval)), t.log_name)
    lines = [(i * step_ms, 0, line) for i, line in enumerate((t.log or "").splitlines())]  # blank lines too
    events = sorted(lines + _sample_inputs(t, step_ms) + _dump_inputs(t, base, run.errors), key=lambda e: (e[0], e[1]))
    instants = [(ms, [e[2] for e in group]) for ms, group in groupby(events, key=lambda e: e[0])][::-1]
    outcome = Outcome(t.name)
    with tempfile.TemporaryDirectory(prefix="precision-agent-ruletest-") as tmp:
        target = Path(tmp) / "input.log"
        with open(target, "a", encoding="utf-8") as run.log:
            if t.log is not None:
                run.stream = LogStream(str(target), t.labels, t.parser_format, None, pattern=t.pattern)
            try:
                for check in sorted(t.alert_rule_test, key=lambda a: a.eval_time):
                    at = _ms(check.eval_time)
                    while instants and instants[-1][0] <= at:  # latest first: pop() takes the earliest
                        run.feed(*instants.pop())
                    run.evaluate_until(at, inclusive=True)
                    outcome.problems += _compare(check, run)
            finally:
                if run.stream is not None:
                    run.stream.close()
    outcome.problems += [f"error while running: {e}" for e in run.errors]
    return outcome


def _guarded(t: RuleTest, rules: RuleSet, evaluation_interval: float, base: Path) -> Outcome:
    """One test whatever its inputs do: an unexpected error fails that test, not the run."""
    try:
        return run_test(t, rules, evaluation_interval, base)
    except Exception as exc:
        return Outcome(t.name, [f"error while running: {exc!r}"])


def _fits(exp: ExpectedAlert, name: str, labels: dict[str, str], annotations: dict[str, str]) -> bool:
    want = dict(exp.exp_labels)
    if SUSPECT not in want:  # the agent's verdict label (engine/suspect.py) is checked only where a test names it
        labels = {k: v for k, v in labels.items() if k != SUSPECT}
    if want.pop("alertname", name) != name or want != labels:
        return False
    return all(annotations.get(k) == v for k, v in (exp.exp_annotations or {}).items())


def _compare(check: AlertRuleTest, run: _Run) -> list[str]:
    name = check.alertname
    got = run.alerts(name, AlertState.FIRING)
    left = list(got)
    missing = []
    for exp in check.exp_alerts:
        hit = next((g for g in left if _fits(exp, name, *g)), None)
        if hit is None:
            missing.append(exp)
        else:
            left.remove(hit)
    if not missing and not left:
        return []
    keys = {k for e in check.exp_alerts for k in (e.exp_annotations or {})}  # shown: what is compared
    hide = set() if any(SUSPECT in e.exp_labels for e in check.exp_alerts) else {SUSPECT}
    got, left = ([({k: v for k, v in la.items() if k not in hide}, {k: v for k, v in an.items() if k in keys})
                  for la, an in alerts] for alerts in (got, left))
    lines = [f"alertname: {name}, time: {check.eval_time:g}s,",
             "    exp: " + _listing([(dict(e.exp_labels), e.exp_annotations) for e in check.exp_alerts]),
             "    got: " + _listing(got)]
    lines += ["    - missing:    " + _show(dict(e.exp_labels), e.exp_annotations) for e in missing]
    lines += ["    + unexpected: " + _show(*g) for g in left]
    if pending := run.alerts(name, AlertState.PENDING):
        lines.append("    (pending, not compared: " + ", ".join(_braces(p[0]) for p in pending) + ")")
    return ["\n".join(lines)]


def _braces(d: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(d.items())) + "}"


def _show(labels: dict[str, str], annotations: dict[str, str] | None) -> str:
    return _braces(labels) + (f" annotations {_braces(annotations)}" if annotations else "")


def _listing(items: list[tuple[dict[str, str], dict[str, str] | None]]) -> str:
    if not items:
        return "[]"
    return "[\n" + "".join(f"        {i}: {_show(*it)}\n" for i, it in enumerate(items)) + "    ]"


# -- command line --------------------------------------------------------------------------------
def run_file(path: Path, run_filter: UserRegex | None = None, out: Any = None) -> int:
    """Run one test file and print its report; returns its exit status."""
    out = out or sys.stdout
    print(f"Unit Testing: {path}", file=out)
    try:
        tf = load_test_file(path)
        rules = load_rules_for(path, tf)
    except ConfigError as exc:
        print(f"  FAILED: {exc}", file=out)
        return EXIT_BAD_FILE
    outcomes = [_guarded(t, rules, tf.evaluation_interval, path.parent) for t in tf.tests
                if run_filter is None or run_filter.search(t.name)]
    failed = [o for o in outcomes if o.problems]
    if not failed:
        print(f"  SUCCESS ({len(outcomes)} test(s))", file=out)
        return EXIT_OK
    print("  FAILED:", file=out)
    for o in failed:
        for p in o.problems:
            print(f'    {path}: test "{o.name}": ' + p.replace("\n", "\n    "), file=out)
    return EXIT_FAILED


def run(args: argparse.Namespace) -> int:
    """Run every test file; the worst status wins (2 bad file > 1 failed test > 0)."""
    try:
        run_filter = UserRegex(args.run, "--run") if getattr(args, "run", None) else None
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_FILE
    status = EXIT_OK
    for f in args.files:
        status = max(status, run_file(Path(f), run_filter))
    return status


def main(argv: list[str] | None = None) -> int:
    """``python -m precision_agent.commands.ruletest test FILE...``: the same as ``precision-agent rules test``."""
    parser = argparse.ArgumentParser(prog="python -m precision_agent.commands.ruletest",
                                     description="unit-test rule files (like promtool test rules)")
    sub = parser.add_subparsers(dest="rules_command", metavar="SUBCOMMAND")
    add_rules_test_args(sub.add_parser("test", help="unit-test rule files"))
    args = parser.parse_args(argv)
    if args.rules_command != "test":
        parser.print_help()
        return EXIT_BAD_FILE
    return run_command(run, args)


if __name__ == "__main__":
    sys.exit(main())
