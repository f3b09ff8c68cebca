"""Write-to-/metrics latency: how long after a training log line is written does
``precision_agent_training_step`` show its iteration on ``/metrics``?

The real agent runs as a subprocess on a tmp dir. This process plays both the training job (it
keeps the log open with O_APPEND and writes one Megatron-LM line per sample, as a job whose
stdout is redirected to a file does) and the scraper (it polls ``/metrics`` every ``poll`` seconds
until the new iteration shows, or ``deadline`` passes). Samples are spaced 50-300 ms apart at
random, so they do not phase-lock with the agent's 1 s evaluation tick.

What one sample says:

* ``latency`` = arrival of the first ``/metrics`` answer that shows the iteration − the write.
  This is what a client sees; it over-states the agent's own delay by at most one poll interval
  plus one scrape.
* ``lower_bound`` = start of the last scrape that did *not* show it − the write (0 when the first
  scrape already showed it). The true moment the value became visible lies between the two.

The agent's config ``debounce`` holds bursts only: a change that comes after a quiet ``debounce``
(every sample here: they are 50-300 ms apart) is read at once, so it is no floor under a sample.
Polling is not free: the agent
renders ``/metrics`` for every poll, so the report also gives the agent's CPU during each run.
A second run with a slower poll (50 ms) shows how much the tight poll perturbs the result.

The push path (latency_push.py): a line with a NaN loss written -> the alert firing on the
agent's ``/api/v1/alerts``, and -> received by a real Alertmanager's webhook. Goals: p99 <= 100 ms
to the API, p99 <= 1 s to the webhook. Percentiles are nearest-rank: with N < 100 the p99 is the
maximum.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from . import common
from .latency_push import run_push

NAME = "latency"
GOAL_MEDIAN_S = 0.5
GOAL_API_P99_S = 0.1       # push path: line written -> alert firing on /api/v1/alerts
GOAL_WEBHOOK_P99_S = 1.0   # -> received by the Alertmanager webhook


def p99(values: list[float]) -> float:
    return common.percentile(values, 99)
STEP = common.METRIC + "training_step"


def _visible_step(agent: common.AgentProcess) -> float | None:
    vals = common.metric_values(agent.metrics(), STEP)
    return max(vals) if vals else None


def _one(agent: common.AgentProcess, fd: int, iteration: int, poll: float, deadline: float,
         scrape_times: list[float]) -> tuple[float | None, float, int]:
    """Write one line; poll until it shows. Returns (latency or None on timeout, lower bound, scrapes)."""
    line = common.megatron_line(iteration).encode()
    t0 = time.monotonic()
    os.write(fd, line)
    last_fail_start: float | None = None
    scrapes = 0
    while True:
        s = time.monotonic()
        if s - t0 > deadline:
            return None, (last_fail_start or t0) - t0, scrapes
        step = _visible_step(agent)
        e = time.monotonic()
        scrapes += 1
        scrape_times.append(e - s)
        if step is not None and step >= iteration:
            lower = 0.0 if last_fail_start is None else max(0.0, last_fail_start - t0)
            return e - t0, lower, scrapes
        last_fail_start = s
        pause = s + poll - time.monotonic()
        if pause > 0:
            time.sleep(pause)


def _series_run(agent: common.AgentProcess, fd: int, first_iteration: int, n: int, poll: float,
                spacing: tuple[float, float], deadline: float, rng: random.Random) -> dict[str, Any]:
    latencies: list[float | None] = []
    lowers: list[float] = []
    scrape_times: list[float] = []
    scrapes = 0
    before = agent.sample()
    it = first_iteration
    for _ in range(n):
        time.sleep(rng.uniform(*spacing))
        lat, low, k = _one(agent, fd, it, poll, deadline, scrape_times)
        latencies.append(lat)
        lowers.append(low)
        scrapes += k
        it += 1
    after = agent.sample()
    ok = [v for v in latencies if v is not None]
    stats = common.summarize(ok)
    return {
        "poll_interval_s": poll,
        "n": n,
        "timeouts": sum(1 for v in latencies if v is None),
        "samples_s": latencies,
        "lower_bounds_s": lowers,
        **stats,
        "p99_s": p99(ok),
        "lower_bound": {k: v for k, v in common.summarize(lowers).items() if k != "n"},
        "ratio_median_to_goal": stats["median_s"] / GOAL_MEDIAN_S,
        "meets_goal": bool(stats["median_s"] < GOAL_MEDIAN_S) if ok else False,
        "scrapes": scrapes,
        "scrape_median_s": common.percentile(scrape_times, 50),
        "scrape_max_s": max(scrape_times) if scrape_times else None,
        "agent_cpu_percent": common.cpu_percent(before, after),
        "wall_s": after.t - before.t,
        "next_iteration": it,
    }


def _background_files(d: Path, files: int) -> None:
    """Other, idle logs the agent also follows (they make its periodic resync longer)."""
    if files <= 0:
        return
    (d / "other").mkdir()
    for i in range(files):
        with open(d / "other" / f"rank{i:05d}.log", "w", encoding="utf-8") as f:
            f.write(common.megatron_line(1))


def run(n: int = 50, polls: tuple[float, ...] = (0.005, 0.05), spacing: tuple[float, float] = (0.05, 0.3),
        deadline: float = 5.0, seed: int = 1, idle_files: int = 0, push_n: int = 20,
        quick: bool = False) -> dict[str, Any]:
    rng = random.Random(seed)
    agent = common.AgentProcess()
    _background_files(agent.watch_dir, idle_files)
    with agent:
        log = agent.watch_dir / "train.log"
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            # warm-up (not recorded): the stream is open and one line has gone end to end
            os.write(fd, common.megatron_line(1).encode())
            warm, _, _ = _one(agent, fd, 2, 0.01, 30.0, [])
            if warm is None:
                raise common.AgentError("warm-up line never showed on /metrics:\n" + agent.log_tail())
            it = 3
            runs = []
            for poll in polls:
                r = _series_run(agent, fd, it, n, poll, spacing, deadline, rng)
                it = r.pop("next_iteration")
                runs.append(r)
            rss = agent.sample()
        finally:
            os.close(fd)
        startup = agent.startup_s
    push = run_push(push_n, polls[0], spacing, deadline, rng, p99) if push_n > 0 else None
    primary = runs[0]
    return {
        "bench": NAME,
        "date": common.now_iso(),
        "quick": quick,
        "host": common.host_info(),
        "agent_config": common.agent_defaults(),
        "params": {"n": n, "poll_intervals_s": list(polls), "spacing_s": list(spacing),
                   "deadline_s": deadline, "seed": seed, "idle_files": idle_files,
                   "push_n": push_n},
        "goal": {"median_s": GOAL_MEDIAN_S, "push_api_p99_s": GOAL_API_P99_S,
                 "push_webhook_p99_s": GOAL_WEBHOOK_P99_S},
        "startup_s": startup,
        "stop_s": agent.stop_s,
        "exit_code": agent.exit_code,
        "agent_rss_mb_after": rss.rss_bytes / common.MB,
        "runs": runs,
        "push": push,
        "summary": {"poll_interval_s": primary["poll_interval_s"], "median_s": primary["median_s"],
                    "p90_s": primary["p90_s"], "p99_s": primary["p99_s"], "max_s": primary["max_s"],
                    "ratio_median_to_goal": primary["ratio_median_to_goal"],
                    "meets_goal": primary["meets_goal"], "timeouts": primary["timeouts"],
                    "debounce_s": common.agent_defaults()["debounce_s"]},
    }


def _ms(v: float | None) -> str:
    return "   n/a" if v is None else f"{v * 1000:6.1f}"


def report(res: dict[str, Any]) -> str:
    cfg = res["agent_config"]
    lines = [f"latency: log line written -> iteration visible on /metrics   ({res['date']}, "
             f"{res['host']['cpus']} CPUs, agent {res['host']['agent_version']})",
             f"  {res['params'].get('idle_files', 0)} other idle log file(s) followed;"
             f" agent start to ready {res['startup_s']:.2f} s; config debounce "
             f"{cfg['debounce_s'] * 1000:.0f} ms (bursts only) (evaluation_interval {cfg['evaluation_interval_s']:g} s)"]
    for r in res["runs"]:
        lo = r["lower_bound"]
        lines.append(
            f"  poll {r['poll_interval_s'] * 1000:4.0f} ms  N={r['n']:<3d} median {_ms(r['median_s'])} ms"
            f"  p90 {_ms(r['p90_s'])}  p99 {_ms(r['p99_s'])}  max {_ms(r['max_s'])}  min {_ms(r['min_s'])}"
            f"  | lower bound median {_ms(lo['median_s'])}  | timeouts {r['timeouts']}")
        lines.append(
            f"      median/goal {r['ratio_median_to_goal']:.3f} "
            f"({'within' if r['meets_goal'] else 'OVER'} goal median < {GOAL_MEDIAN_S * 1000:.0f} ms);"
            f" {r['scrapes']} scrapes, scrape median {_ms(r['scrape_median_s']).strip()} ms;"
            f" agent CPU meanwhile {r['agent_cpu_percent']:.1f} % of a core")
    push = res.get("push")
    if push:
        lines += _push_report(push)
    s = res["summary"]
    lines.append(f"  => median {s['median_s'] * 1000:.1f} ms vs goal < {GOAL_MEDIAN_S * 1000:.0f} ms: "
                 f"ratio {s['ratio_median_to_goal']:.3f} "
                 f"({'within goal' if s['meets_goal'] else 'OVER GOAL'})")
    return "\n".join(lines)


def _push_report(p: dict[str, Any]) -> list[str]:
    a = p["api"]
    ok = a["n"] and a["p99_s"] <= GOAL_API_P99_S and not a["timeouts"]
    out = [f"  push path, N={p['n']} NaN-loss lines -> {p['alert']} (each a new alert), poll {p['poll_interval_s'] * 1000:.0f} ms;"
           f" agent CPU meanwhile {p['agent_cpu_percent']:.1f} % of a core",
           f"      -> /api/v1/alerts firing: median {_ms(a['median_s'])} ms  p90 {_ms(a['p90_s'])}  p99 {_ms(a['p99_s'])}"
           f"  max {_ms(a['max_s'])}  | timeouts {a['timeouts']}  | p99/goal {a['p99_s'] / GOAL_API_P99_S:.3f}"
           f" ({'within' if ok else 'OVER'} goal p99 <= {GOAL_API_P99_S * 1000:.0f} ms)"]
    w = p.get("webhook")
    if w is None:
        out.append(f"      -> Alertmanager webhook: NOT MEASURED: {p['alertmanager_unavailable']}")
    else:
        ok = w["n"] and w["p99_s"] <= GOAL_WEBHOOK_P99_S and not w["timeouts"]
        out.append(f"      -> Alertmanager webhook: median {_ms(w['median_s'])} ms  p90 {_ms(w['p90_s'])}"
                   f"  p99 {_ms(w['p99_s'])}  max {_ms(w['max_s'])}  | timeouts {w['timeouts']}, {w['posts']} POSTs"
                   f"  | p99/goal {w['p99_s'] / GOAL_WEBHOOK_P99_S:.3f}"
                   f" ({'within' if ok else 'OVER'} goal p99 <= {GOAL_WEBHOOK_P99_S * 1000:.0f} ms; {p['alertmanager']})")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=None, help="samples per poll interval (default 50, quick 10)")
    p.add_argument("--poll-ms", type=float, action="append", default=None,
                   help="poll interval in ms, repeatable (default 5 and 50)")
    p.add_argument("--deadline", type=float, default=5.0, help="give up on one sample after this many s")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--idle-files", type=int, default=0,
                   help="other idle logs the agent also follows (default 0; try 10000 for the resync's effect)")
    p.add_argument("--push-n", type=int, default=None,
                   help="push-path events (alert on the API and at an Alertmanager webhook); 0 skips"
                        " (default 20, quick 5)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    n = args.n if args.n is not None else (10 if args.quick else 50)
    polls = tuple(ms / 1000 for ms in (args.poll_ms or [5.0, 50.0]))
    push_n = args.push_n if args.push_n is not None else (5 if args.quick else 20)
    return run(n=n, polls=polls, deadline=args.deadline, seed=args.seed, idle_files=args.idle_files,
               push_n=push_n, quick=args.quick)


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], NAME, argv)


if __name__ == "__main__":
    sys.exit(main())
