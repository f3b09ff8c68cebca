"""Fleet figures: what one 8-rank host's agent costs a Prometheus, and what a scrape costs the host.

The real agent, with the shipped rules, watches one run's logs on an ``ranks``-rank host
(``train_rank<R>.log``, ``lines`` Megatron-LM lines each, read in full before measuring). Two
states are measured: ``healthy`` (training goes on) and ``incident`` (every rank then logs NaN,
so every rank has its TrainingNonFinite firing and its first non-finite step exported, which is
the most series a host exports for one run). In each state:

- ``series``: samples on /metrics (what Prometheus stores as active series for this target,
  before its own ``up``/``scrape_*`` series), and per metric family;
- ``bytes``: size of the /metrics body (the agent sends it uncompressed);
- ``scrape_s``: wall time of a GET of /metrics, median and p90 of ``scrapes`` sequential GETs;
- ``cpu_ms_per_scrape``: the agent's CPU (utime+stime from /proc/<pid>/stat) over ``scrapes``
  back-to-back GETs, divided by their number (one GET is below the 10 ms tick; many are not);
- ``idle_cpu_percent``: the agent's CPU over ``idle`` seconds without scrapes, for reference.

docs/fleet.md turns these into the Prometheus cost of 1,000 and 10,000 hosts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from . import common

NAME = "fleet"


def _nan_line(iteration: int, when: float) -> str:
    return common.megatron_line(iteration, float("nan"), when).replace("grad norm: 2.513", "grad norm: nan")


def _series(text: str) -> tuple[int, dict[str, int]]:
    by_family: Counter[str] = Counter()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            for suffix in ("_total", "_created"):
                name = name.removesuffix(suffix)
            by_family[name] += 1
    return sum(by_family.values()), dict(by_family.most_common())


def _alerts_firing(agent: common.AgentProcess) -> int:
    return sum(1 for line in agent.metrics().splitlines()
               if line.startswith(common.METRIC + "alerts{") and 'alertstate="firing"' in line)


def measure(agent: common.AgentProcess, scrapes: int, idle: float) -> dict[str, Any]:
    text = agent.metrics()
    series, families = _series(text)
    walls = []
    a = agent.sample()
    for _ in range(scrapes):
        t = time.monotonic()
        agent.metrics()
        walls.append(time.monotonic() - t)
    b = agent.sample()
    time.sleep(0.5)   # the last scrape's handler is done
    c = agent.sample()
    time.sleep(idle)
    d = agent.sample()
    return {"series": series, "families": families, "bytes": len(text.encode()),
            "scrape_s": {"median": common.percentile(walls, 50), "p90": common.percentile(walls, 90),
                         "max": max(walls)},
            "cpu_ms_per_scrape": 1000 * (b.cpu_s - a.cpu_s) / scrapes,
            "idle_cpu_percent": common.cpu_percent(c, d), "rss_mb": d.rss_bytes / common.MB}


def run(ranks: int = 8, lines: int = 200, scrapes: int = 200, idle: float = 10.0,
        quick: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="precision-agent-bench-fleet-") as d:
        watch = Path(d)
        t0 = time.time() - 3600
        for r in range(ranks):
            (watch / f"train_rank{r}.log").write_text(
                "".join(common.megatron_line(k + 1, 6.0 - k * 1e-4, t0 + k) for k in range(lines)))
        with common.AgentProcess(watch) as agent:
            deadline = time.monotonic() + 60
            while common.metric_values(agent.metrics(), common.METRIC + "log_lines_read_total")[0] < ranks * lines:
                if time.monotonic() > deadline:
                    raise common.AgentError("the agent did not read the logs:\n" + agent.log_tail())
                time.sleep(0.1)
            time.sleep(1.0)
            healthy = measure(agent, scrapes, idle)
            for r in range(ranks):   # every rank goes NaN (the all-reduce), three steps in a row
                with open(watch / f"train_rank{r}.log", "a", encoding="utf-8") as f:
                    f.write("".join(_nan_line(lines + k + 1, time.time()) for k in range(3)))
            deadline = time.monotonic() + 60
            while _alerts_firing(agent) < ranks:
                if time.monotonic() > deadline:
                    raise common.AgentError(f"{_alerts_firing(agent)} of {ranks} alerts firing:\n" + agent.log_tail())
                time.sleep(0.1)
            time.sleep(1.0)
            incident = measure(agent, scrapes, idle)
            incident["alerts_firing"] = _alerts_firing(agent)
            startup = agent.startup_s
    return {"bench": NAME, "date": common.now_iso(), "quick": quick, "host": common.host_info(),
            "agent_config": common.agent_defaults(),
            "params": {"ranks": ranks, "lines_per_rank": lines, "scrapes": scrapes, "idle_s": idle},
            "startup_s": startup, "exit_code": agent.exit_code, "healthy": healthy, "incident": incident}


def report(res: dict[str, Any]) -> str:
    p = res["params"]
    out = [f"fleet: one {p['ranks']}-rank host, shipped rules   ({res['date']}, {res['host']['cpus']} CPUs, "
           f"agent {res['host']['agent_version']})"]
    for state in ("healthy", "incident"):
        m = res[state]
        out.append(f"  {state:8s}: {m['series']} series, /metrics {m['bytes']} B; scrape median "
                   f"{m['scrape_s']['median'] * 1000:.1f} ms (p90 {m['scrape_s']['p90'] * 1000:.1f} ms); "
                   f"agent CPU {m['cpu_ms_per_scrape']:.2f} ms per scrape; idle {m['idle_cpu_percent']:.2f} % "
                   f"of a core; RSS {m['rss_mb']:.1f} MB")
        top = ", ".join(f"{k.removeprefix(common.METRIC)} {v}" for k, v in list(m["families"].items())[:6])
        out.append(f"            largest families: {top}")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=8, help="ranks on the host (default 8)")
    p.add_argument("--lines", type=int, default=200, help="log lines per rank before measuring (default 200)")
    p.add_argument("--scrapes", type=int, default=None, help="GETs of /metrics per state (default 200, quick 30)")
    p.add_argument("--idle", type=float, default=None, help="idle window per state, s (default 10, quick 2)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(ranks=args.ranks, lines=args.lines,
               scrapes=args.scrapes if args.scrapes is not None else (30 if q else 200),
               idle=args.idle if args.idle is not None else (2.0 if q else 10.0), quick=q)


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], NAME, argv)


if __name__ == "__main__":
    sys.exit(main())
