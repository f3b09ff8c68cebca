"""Idle cost: what the agent takes from a training host while nothing happens.

The real agent watches a tmp dir holding ``files`` log files of ``lines`` Megatron-LM lines each.
After it is ready and has read them all (checked on ``/metrics``) and a short settle, this bench
reads ``/proc/<pid>/stat`` (utime+stime, all threads) and ``/proc/<pid>/status`` (VmRSS, VmHWM,
Threads) once a second for ``duration`` seconds, with no writes and no scrapes. The window
usually contains one periodic resync (every 30 s by default), as real life does.

A second window does the same while a scraper GETs ``/metrics`` as Prometheus 3 does (its
Accept header, which gets OpenMetrics, and gzip) every ``scrape_interval`` seconds; the difference to the idle rate, per scrape, is the cost of a scrape.

Goals: CPU < 1 % of one core, RSS < 100 MB (10^6 bytes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common

NAME = "idle"
GOAL_CPU_PERCENT = 1.0
GOAL_RSS_MB = 100.0


def _make_logs(d: Path, files: int, lines: int, stuck: bool = False) -> int:
    """Healthy runs (the loss falls 0.5 % a step), or with ``stuck`` a loss that barely moves
    (1e-4 a step): then each file's series fires TrainingLossStuck once 70 lines are read."""
    t0 = time.time() - 3600
    for i in range(files):
        with open(d / f"rank{i:03d}.log", "w", encoding="utf-8") as f:
            f.write("".join(common.megatron_line(k + 1, 6.0 - k * 1e-4 if stuck else 6.0 * 0.995 ** k, t0 + k)
                            for k in range(lines)))
    return files * lines


def _counters(agent: common.AgentProcess) -> dict[str, float]:
    text = agent.metrics()
    out = {}
    for name in ("log_lines_read_total", "resyncs_total", "watch_events_total", "log_records_parsed_total"):
        vals = common.metric_values(text, common.METRIC + name)
        out[name] = vals[0] if vals else float("nan")
    return out


def _window(agent: common.AgentProcess, duration: float, scrape_interval: float | None) -> dict[str, Any]:
    """Sample /proc once a second (and scrape every ``scrape_interval`` if given) for ``duration`` s."""
    samples = [agent.sample()]
    start = samples[0].t
    next_sample = start + 1.0
    next_scrape = start if scrape_interval else float("inf")
    scrapes, scrape_s, body_bytes = 0, [], 0
    while True:
        now = time.monotonic()
        if now >= start + duration:
            break
        if now >= next_scrape:
            s = time.monotonic()
            body_bytes = agent.scrape()
            scrape_s.append(time.monotonic() - s)
            scrapes += 1
            next_scrape += scrape_interval  # type: ignore[operator]
        if now >= next_sample:
            samples.append(agent.sample())
            next_sample += 1.0
        time.sleep(max(0.0, min(next_sample, next_scrape, start + duration) - time.monotonic()))
    samples.append(agent.sample())
    first, last = samples[0], samples[-1]
    per_second = [common.cpu_percent(a, b) for a, b in zip(samples, samples[1:]) if b.t - a.t > 0.5]
    wall = last.t - first.t
    out: dict[str, Any] = {
        "duration_s": wall,
        "cpu_seconds": last.cpu_s - first.cpu_s,
        "cpu_percent_of_core": common.cpu_percent(first, last),
        "cpu_percent_max_1s": max(per_second) if per_second else None,
        "cpu_resolution_percent": 100.0 / common.CLK_TCK / wall,
        # finer cross-check (ns); exact only while no thread ends inside the window
        "cpu_percent_schedstat": 100.0 * (last.run_ns - first.run_ns) / 1e9 / wall,
        "rss_mb": last.rss_bytes / common.MB,
        "rss_mb_min": min(s.rss_bytes for s in samples) / common.MB,
        "rss_mb_max": max(s.rss_bytes for s in samples) / common.MB,
        "hwm_mb": last.hwm_bytes / common.MB,
        "threads": last.threads,
        "threads_max": max(s.threads for s in samples),
        "context_switches_per_s": (last.ctx_switches - first.ctx_switches) / wall,
        "samples": [{"t": round(s.t - start, 3), "cpu_s": s.cpu_s, "rss_mb": s.rss_bytes / common.MB,
                     "threads": s.threads} for s in samples],
    }
    if scrape_interval:
        out.update({"scrape_interval_s": scrape_interval, "scrapes": scrapes,
                    "scrape_median_s": common.percentile(scrape_s, 50),
                    "metrics_bytes": body_bytes})
    return out


def run(files: int = 20, lines: int = 200, duration: float = 30.0, scrape_interval: float = 15.0,
        scrape_duration: float = 60.0, settle: float = 2.0, scrape_burst: int = 200,
        quick: bool = False, stuck: bool = False) -> dict[str, Any]:
    # the files exist before the agent starts: "already there, already read"
    with tempfile.TemporaryDirectory(prefix="precision-agent-bench-logs-") as d:
        watch = Path(d)
        expected = _make_logs(watch, files, lines, stuck)
        with common.AgentProcess(watch) as agent:
            ready_sample = agent.sample()
            # the first pass over 10,000 files on a busy 2-core host can take minutes
            deadline = time.monotonic() + max(60.0, files * 0.12)
            c = {"log_lines_read_total": 0.0}
            while True:
                try:
                    c = _counters(agent)
                except OSError:  # a scrape timed out: the first pass (nice 10, a loaded host) goes on
                    pass
                if c["log_lines_read_total"] >= expected or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            if c["log_lines_read_total"] < expected:
                raise common.AgentError(f"agent read {c['log_lines_read_total']} of {expected} lines:\n"
                                        + agent.log_tail())
            time.sleep(settle)
            before = _counters(agent)
            time.sleep(0.5)  # let the scrape's handler thread go away before the window opens
            idle = _window(agent, duration, None)
            after = _counters(agent)
            idle["resyncs"] = after["resyncs_total"] - before["resyncs_total"]
            idle["watch_events"] = after["watch_events_total"] - before["watch_events_total"]
            scraping = None
            if scrape_duration > 0:
                time.sleep(0.5)
                scraping = _window(agent, scrape_duration, scrape_interval)
                extra = scraping["cpu_seconds"] - idle["cpu_percent_of_core"] / 100 * scraping["duration_s"]
                # coarse (10 ms ticks vs ~1-2 ms per scrape); see scrape_burst for a real figure
                scraping["cpu_ms_per_scrape_over_idle"] = (1000 * extra / scraping["scrapes"]
                                                           if scraping["scrapes"] else None)
            burst = None
            if scrape_burst > 0:  # the cost of one scrape, measurable above the 10 ms tick
                time.sleep(0.5)
                a = agent.sample()
                for _ in range(scrape_burst):
                    agent.scrape()
                b = agent.sample()
                per = (b.cpu_s - a.cpu_s) / scrape_burst
                burst = {"scrapes": scrape_burst, "wall_s": b.t - a.t, "cpu_seconds": b.cpu_s - a.cpu_s,
                         "cpu_ms_per_scrape": 1000 * per,
                         "projected_cpu_percent_at_15s": idle["cpu_percent_of_core"] + 100 * per / 15.0}
            startup = agent.startup_s
            start_rss = ready_sample.rss_bytes / common.MB
    cpu_ratio = idle["cpu_percent_of_core"] / GOAL_CPU_PERCENT
    rss_ratio = idle["rss_mb"] / GOAL_RSS_MB
    hwm_ratio = idle["hwm_mb"] / GOAL_RSS_MB
    return {
        "bench": NAME,
        "date": common.now_iso(),
        "quick": quick,
        "host": common.host_info(),
        "agent_config": common.agent_defaults(),
        "params": {"files": files, "lines_per_file": lines, "duration_s": duration, "settle_s": settle,
                   "scrape_interval_s": scrape_interval, "scrape_duration_s": scrape_duration,
                   "scrape_burst": scrape_burst, "stuck": stuck},
        "goal": {"cpu_percent_of_core": GOAL_CPU_PERCENT, "rss_mb": GOAL_RSS_MB},
        "startup_s": startup,
        "stop_s": agent.stop_s,
        "exit_code": agent.exit_code,
        "lines_read": c["log_lines_read_total"],
        "rss_mb_at_ready": start_rss,
        "idle": idle,
        "scraping": scraping,
        "scrape_burst": burst,
        "ratios": {"cpu": cpu_ratio, "rss": rss_ratio, "hwm": hwm_ratio},
        "meets_goal": {"cpu": cpu_ratio < 1, "rss": rss_ratio < 1, "hwm": hwm_ratio < 1},
    }


def report(res: dict[str, Any]) -> str:
    i, p = res["idle"], res["params"]
    r = res["ratios"]
    lines = [f"idle: {p['files']} fully read log files{' (every one alerting)' if p.get('stuck') else ''},"
             f" no writes   ({res['date']}, "
             f"{res['host']['cpus']} CPUs, agent {res['host']['agent_version']})",
             f"  agent start to ready {res['startup_s']:.2f} s; RSS at ready {res['rss_mb_at_ready']:.1f} MB",
             f"  no scrapes, {i['duration_s']:.1f} s: CPU {i['cpu_percent_of_core']:.3f} % of a core"
             f" (tick resolution {i['cpu_resolution_percent']:.3f} %; schedstat {i['cpu_percent_schedstat']:.3f} %;"
             f" worst 1 s {i['cpu_percent_max_1s']:.1f} %),"
             f" {i['context_switches_per_s']:.1f} context switches/s, {i['resyncs']:.0f} resync(s),"
             f" {i['watch_events']:.0f} watch event(s)",
             f"      CPU  {common.ratio_text(i['cpu_percent_of_core'], GOAL_CPU_PERCENT, ' %')}",
             f"      RSS  {common.ratio_text(i['rss_mb'], GOAL_RSS_MB, ' MB')}"
             f"   (min {i['rss_mb_min']:.1f}, max {i['rss_mb_max']:.1f})",
             f"      peak {common.ratio_text(i['hwm_mb'], GOAL_RSS_MB, ' MB')}   threads {i['threads']}"]
    s = res.get("scraping")
    if s:
        lines.append(f"  scraped as Prometheus does (OpenMetrics, gzip) every {s['scrape_interval_s']:g} s"
                     f" ({s['scrapes']} scrapes of {s['metrics_bytes']} B gzipped,"
                     f" median {s['scrape_median_s'] * 1000:.1f} ms), {s['duration_s']:.1f} s:"
                     f" CPU {s['cpu_percent_of_core']:.3f} % of a core"
                     f" (ratio {s['cpu_percent_of_core'] / GOAL_CPU_PERCENT:.3f})")
        lines.append(f"      RSS {s['rss_mb']:.1f} MB, peak {s['hwm_mb']:.1f} MB, threads max {s['threads_max']}")
    b = res.get("scrape_burst")
    if b:
        lines.append(f"  {b['scrapes']} back-to-back scrapes: {b['cpu_ms_per_scrape']:.2f} ms agent CPU per scrape;"
                     f" idle + one scrape per 15 s = {b['projected_cpu_percent_at_15s']:.3f} % of a core"
                     f" (ratio {b['projected_cpu_percent_at_15s'] / GOAL_CPU_PERCENT:.3f})")
    lines.append(f"  => CPU ratio {r['cpu']:.3f}, RSS ratio {r['rss']:.3f}, peak RSS ratio {r['hwm']:.3f} "
                 f"({'within goals' if all(res['meets_goal'].values()) else 'OVER A GOAL'})")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--files", type=int, default=20, help="idle log files (default 20)")
    p.add_argument("--lines", type=int, default=200, help="lines per file (default 200)")
    p.add_argument("--duration", type=float, default=None, help="idle window, s (default 30, quick 5)")
    p.add_argument("--scrape-interval", type=float, default=None, help="s between scrapes (default 15, quick 2.5)")
    p.add_argument("--scrape-duration", type=float, default=None,
                   help="scraping window, s; 0 skips it (default 60, quick 5)")
    p.add_argument("--stuck", action="store_true",
                   help="every file's loss barely moves: one firing TrainingLossStuck alert per file")
    p.add_argument("--scrape-burst", type=int, default=None,
                   help="back-to-back scrapes to measure one scrape's CPU; 0 skips (default 200, quick 50)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(files=args.files, lines=args.lines,
               duration=args.duration if args.duration is not None else (5.0 if q else 30.0),
               scrape_interval=args.scrape_interval if args.scrape_interval is not None else (2.5 if q else 15.0),
               scrape_duration=args.scrape_duration if args.scrape_duration is not None else (5.0 if q else 60.0),
               scrape_burst=args.scrape_burst if args.scrape_burst is not None else (50 if q else 200),
               settle=1.0 if q else 2.0, quick=q, stuck=args.stuck)


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], NAME, argv)


if __name__ == "__main__":
    sys.exit(main())
