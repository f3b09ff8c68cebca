"""Fuzz: the test suite's hostile-input generators (tests/fuzzing/), run longer.

Every target of ``tests/fuzzing/test_fuzz.py`` (each log parser's line shapes, the run-wide hints, the
reader, every dump reader and the protobuf decoder, rule / config / `rules test` files) gets
``scale`` times its ``make test`` number of cases (default 20: 240,000 cases) under each of
``seeds`` seeds, within a time budget (default 10 minutes, shared by the targets in proportion to
their plan; ``--minutes 0``: none, ~50 minutes on two cores; ``--quick``: 0.2x, no budget) (other seeds
than the suite's 14, so a bench run explores new cases), with inputs up to ``text_max``
characters (the suite: 32 KiB); then hostile HTTP requests against the real daemon. Each batch
runs in a forked child with a 1 GiB address-space cap; a case fails on an undocumented exception,
> 2 s, a hang (killed), a signal or MemoryError (tests/fuzzing/core.py).

Reported: cases, cases/s and failures per target (with seed and case to replay:
``python tests/fuzzing/replay.py TARGET CASE --seed SEED --show``), and the largest peak-RSS
growth. Failures are reported, never raised: the exit status says only whether the bench ran.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import common

TESTS = Path(__file__).resolve().parents[1] / "tests"


def _import() -> Any:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from fuzzing import core, mutate, targets, web  # tests/fuzzing: shared with tests/fuzzing/test_fuzz.py
    return core, mutate, targets, web


def run(seeds: list[int], scale: float = 20.0, text_max: int = 1 << 17, http_cases: int | None = None,
        only: list[str] | None = None, minutes: float | None = None) -> dict[str, Any]:
    """``minutes``: a time budget shared by the targets in proportion to their plan; a target
    stops at the end of the 500-case chunk that used up its share (None: no budget)."""
    core, mutate, targets, web = _import()
    old_max = mutate.TEXT_MAX
    mutate.set_text_max(text_max)
    try:
        return _run(core, targets, web, seeds, scale, text_max, http_cases, only, minutes)
    finally:
        mutate.set_text_max(old_max)


def _run(core: Any, targets: Any, web: Any, seeds: list[int], scale: float, text_max: int,
         http_cases: int | None, only: list[str] | None, minutes: float | None) -> dict[str, Any]:
    per_target: dict[str, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    t0 = time.monotonic()
    names = [n for n in targets.TEST_PLAN if only is None or n in only]
    plan_total = sum(targets.TEST_PLAN[n] for n in names)
    for name in names:
        share = None if minutes is None else minutes * 60 * targets.TEST_PLAN[name] / plan_total / len(seeds)
        count = max(1, int(targets.TEST_PLAN[name] * scale))
        row = per_target.setdefault(name, {"cases": 0, "seconds": 0.0, "failures": 0, "known": 0,
                                           "slowest_s": 0.0, "rss_growth_mb": 0.0})
        for seed in seeds:
            if name == "http":
                with common.AgentProcess() as agent:
                    rep = web.run_http(agent.port, agent.pid, seed, http_cases or count)
                reps = [rep]
            else:
                reps, done, t_seed = [], 0, time.monotonic()
                while done < count and (share is None or time.monotonic() - t_seed < share):
                    n = min(500, count - done)
                    reps.append(core.run_target(targets.TARGETS[name], seed, n, start=done))
                    done += n
            for rep in reps:
                row["cases"] += rep.cases
                row["seconds"] += rep.seconds
                row["slowest_s"] = max(row["slowest_s"], rep.slowest_s)
                row["rss_growth_mb"] = max(row["rss_growth_mb"], rep.rss_growth_mb)
                for f in rep.failures:
                    known = targets.known_issue(name, f.detail)
                    row["known" if known else "failures"] += 1
                    failures.append({**asdict(f), "known_issue": known})
        row["cases_per_s"] = row["cases"] / max(row["seconds"], 1e-9)
        print(f"  {name}: {row['cases']} cases, {row['cases_per_s']:,.0f}/s, {row['failures']} failures"
              f" ({row['known']} known)", flush=True)
    total = sum(r["cases"] for r in per_target.values())
    wall = time.monotonic() - t0
    return {"bench": "fuzz", "date": common.now_iso(), "host": common.host_info(),
            "params": {"seeds": seeds, "scale": scale, "text_max": text_max, "targets": names, "minutes": minutes},
            "cases": total, "seconds": wall, "cases_per_s": total / max(wall, 1e-9),
            "failures": sum(r["failures"] for r in per_target.values()),
            "known_failures": sum(r["known"] for r in per_target.values()),
            "max_rss_growth_mb": max((r["rss_growth_mb"] for r in per_target.values()), default=0.0),
            "targets": per_target, "failure_list": failures[:200]}


def report(res: dict[str, Any]) -> str:
    p = res["params"]
    lines = [f"fuzz: {res['cases']:,} cases in {res['seconds']:.0f} s ({res['cases_per_s']:,.0f} cases/s), "
             f"seeds {p['seeds']}, x{p['scale']:g} the test plan, inputs up to {p['text_max']:,} chars",
             f"  failures: {res['failures']} (+ {res['known_failures']} known, outside this suite's code); "
             f"largest peak-RSS growth of a target {res['max_rss_growth_mb']:.0f} MB"]
    for name, r in res["targets"].items():
        lines.append(f"  {name:15s} {r['cases']:8,} cases {r['cases_per_s']:9,.0f}/s  slowest {r['slowest_s'] * 1000:6.0f} ms"
                     f"  failures {r['failures']} (known {r['known']})")
    for f in res["failure_list"][:20]:
        tag = " [known]" if f["known_issue"] else ""
        lines.append(f"  FAIL{tag} {f['target']} seed={f['seed']} case={f['index']}: {f['kind']}: {f['detail'][:160]}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, action="append", default=None,
                   help="repeatable (default 1001)")
    p.add_argument("--scale", type=float, default=None, help="times the make-test plan per seed (default 20, quick 0.2)")
    p.add_argument("--text-max", type=int, default=None, help="largest generated text (default 131072, quick 32768)")
    p.add_argument("--target", action="append", default=None, help="only this target (repeatable)")
    p.add_argument("--minutes", type=float, default=None,
                   help="time budget shared by the targets (default 10; quick and 0: none)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(seeds=args.seed or [1001], scale=args.scale or (0.2 if q else 20.0),
               text_max=args.text_max or ((1 << 15) if q else (1 << 17)), only=args.target,
               minutes=None if q or args.minutes == 0 else (args.minutes or 10.0))


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], "fuzz", argv)


if __name__ == "__main__":
    raise SystemExit(main())
