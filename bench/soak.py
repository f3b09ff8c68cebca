"""Soak: everything hostile at once for N minutes while a real NaN arrives (issue 23).

The real agent (shipped rules, default limits unless given) follows a log tree and a dump tree on
a private tmp dir, with its state directory on a small tmpfs that is then filled up:

* ``files`` idle log files (plain text, no records) it must follow within ``max_open_files``
  (``limits.max_files`` is raised to hold them all);
* one over-long line (``long_line_mb``, no newline until its end) written into the live log
  ``train.log``, followed by a NaN record (its latency is measured like the others);
* ``junk`` tiny unreadable "tensor" files in the dump watch (``step<k>/junk<i>.npy``);
* a full disk: the state dir is a tmpfs of ``state_kb`` KiB, filled to the last byte after the
  agent started (needs root for ``mount``; without it the criterion says "not simulated");
* every ``nan_every`` seconds a new run's log appears with finite records and a NaN grad norm.

Criteria, each reported pass/fail (the bench exits 0 whenever it ran; ``--strict`` exits 1 on a
failed criterion):

* ``latency``: every NaN paged (``TrainingNonFinite`` firing on /api/v1/alerts) within
  ``GOAL_LATENCY_S`` of the write of its line, none missed;
* ``rss``: peak RSS (VmHWM) below ``GOAL_RSS_MB``;
* ``descriptors``: at every sample, descriptors on the log tree at most ``max_open_files`` (as the
  agent exports it, +1 for the file being opened) and all descriptors below the soft RLIMIT_NOFILE;
* ``error_repeats``: no ERROR line of the agent's log repeated with the same message (a cause is
  said once per change, not at every pass or rescan);
* ``ready``: /-/ready answered 200 at every sample (the agent never stalled).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from . import common

NAME = "soak"
GOAL_LATENCY_S = 2.0
GOAL_RSS_MB = 150.0
ALERT = "TrainingNonFinite"


def _nan_line(iteration: int) -> str:
    return common.megatron_line(iteration).replace("grad norm: 2.513", "grad norm: nan")


def _make_tree(root: Path, files: int, junk: int) -> tuple[Path, Path]:
    logs, dumps = root / "logs", root / "dumps"
    (logs / "idle").mkdir(parents=True, exist_ok=True)
    text = "".join(f"data loader worker {i} ready, prefetch factor 2\n" for i in range(20))
    for i in range(files):
        (logs / "idle" / f"worker{i:05d}.log").write_text(text)
    with open(logs / "train.log", "w") as f:
        f.writelines(common.megatron_line(it) for it in range(1, 4))
    per_dir = 1000
    for i in range(junk):
        d = dumps / f"step{i // per_dir:04d}"
        if i % per_dir == 0:
            d.mkdir(parents=True, exist_ok=True)
        (d / f"junk{i:06d}.npy").write_bytes(b"\x93NUMPY junk %d" % i)
    dumps.mkdir(exist_ok=True)
    return logs, dumps


def _mount_small_state(state: Path, kib: int) -> str:
    """A tmpfs of ``kib`` KiB on the state dir; '' when done, else why not."""
    state.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(state)], check=True,
                       capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        return f"cannot mount a tmpfs ({exc} {err.decode(errors='replace').strip()})"
    return ""


def _fill(state: Path) -> int:
    """Fill the state file system to the last byte; the bytes written."""
    n = 0
    fd = os.open(state / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        block = b"\0" * (64 << 10)
        while len(block) >= 512:
            try:
                n += os.write(fd, block)
            except OSError:
                block = block[: len(block) // 2]
    finally:
        os.close(fd)
    return n


def _long_line(log: Path, mb: int, done: list[float]) -> None:
    """The over-long line (1 MiB per write, as a job printing a huge tensor would), then a NaN."""
    block = b"x" * (1 << 20)
    with open(log, "ab") as f:
        for _ in range(mb):
            f.write(block)
        f.write(b"\n")
        f.flush()
        done.append(time.monotonic())
        f.write(_nan_line(4).encode())
    done.append(time.monotonic())


def _fds(pid: int, logs: Path) -> tuple[int, int]:
    total = on_logs = 0
    prefix = str(logs) + "/"
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        total += 1
        on_logs += target.startswith(prefix)
    return total, on_logs


def _soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            v = line.split()[3]
            return 1 << 62 if v == "unlimited" else int(v)
    return 1 << 62


def _firing_runs(agent: common.AgentProcess) -> set[str]:
    status, body = common.http_get(agent.port, "/api/v1/alerts")
    if status != 200:
        return set()
    return {a["labels"].get("run", "") for a in json.loads(body)["data"]["alerts"]
            if a.get("alertname") == ALERT and a.get("state") == "firing"}


def _metric(text: str, name: str) -> float:
    vals = common.metric_values(text, common.METRIC + name)
    return vals[0] if vals else float("nan")


_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ERROR (.*)$")


def _error_repeats(log_text: str) -> Counter[str]:
    return Counter(m.group(1) for line in log_text.splitlines() if (m := _STAMP.match(line)))


def run(minutes: float = 10.0, files: int = 10_000, long_line_mb: int = 200, junk: int = 50_000,
        nan_every: float = 10.0, state_kb: int = 4096, max_open_files: int | None = None,
        quick: bool = False) -> dict[str, Any]:
    # followed files: the idle ones, train.log and one per NaN (the default limits.max_files is
    # 10,000: past it a new run's log is refused with a `watch` error and its NaN never paged)
    cfg_limits: dict[str, int] = {"max_files": files + 100 + int(minutes * 60 / nan_every)}
    if max_open_files:
        cfg_limits["max_open_files"] = max_open_files
    agent = common.AgentProcess(ready_timeout=120.0, stop_timeout=30.0)
    root = agent.root
    t_setup = time.monotonic()
    try:
        logs, dumps = _make_tree(root, files, junk)
    except BaseException:
        agent._tmp.cleanup()
        raise
    agent.watch_dir = logs
    (root / "config.yml").write_text(json.dumps({"limits": cfg_limits}))
    agent.extra_args = ["--watch", f"dump:{dumps}", "--config", str(root / "config.yml")]
    setup_s = time.monotonic() - t_setup
    why_no_full_disk = _mount_small_state(agent.state_dir, state_kb)
    mounted = not why_no_full_disk
    samples: list[dict[str, Any]] = []
    latencies: dict[str, float | None] = {}
    long_done: list[float] = []
    try:
        agent.start()
        filled = _fill(agent.state_dir) if mounted else 0
        pending: dict[str, float] = {}  # run -> monotonic time of the write of its NaN line
        writer = threading.Thread(target=_long_line, args=(logs / "train.log", long_line_mb, long_done),
                                  daemon=True)
        writer.start()
        long_pending = True
        t0 = time.monotonic()
        end = t0 + minutes * 60
        next_nan, k, next_sample = t0 + 2.0, 0, t0
        while time.monotonic() < end or pending:
            now = time.monotonic()
            if now > end + GOAL_LATENCY_S * 10:  # what is still pending now is missed
                break
            if now >= next_nan and now < end:
                k += 1
                run_name = f"job{k:04d}"
                text = "".join(common.megatron_line(it) for it in range(1, 4)) + _nan_line(4)
                path = logs / f"{run_name}.log"
                pending[run_name] = time.monotonic()
                path.write_text(text)
                next_nan += nan_every
            if long_pending and len(long_done) == 2:
                pending["train"] = long_done[1]
                long_pending = False
            if pending:
                firing = _firing_runs(agent)
                for name in [n for n in pending if n in firing]:
                    latencies[name] = time.monotonic() - pending.pop(name)
            if now >= next_sample:
                next_sample = now + 1.0
                total, on_logs = _fds(agent.pid, logs)
                try:
                    ready = common.http_get(agent.port, "/-/ready", timeout=2.0)[0] == 200
                    text = agent.metrics()
                except OSError:
                    ready, text = False, ""
                ps = agent.sample()
                samples.append({"t": now - t0, "fds": total, "fds_logs": on_logs, "ready": ready,
                                "rss_mb": ps.rss_bytes / common.MB,
                                "max_open_files": _metric(text, "max_open_files"),
                                "unread_bytes": _metric(text, "log_unread_bytes"),
                                "soft_nofile": _soft_nofile(agent.pid)})
            time.sleep(0.05)
        for name in pending:
            latencies[name] = None
        hwm = agent.sample().hwm_bytes / common.MB
        final = agent.metrics()
    finally:
        agent.stop()
        log_text = agent.log_tail(1 << 30)
        if mounted:
            subprocess.run(["umount", "-l", str(agent.state_dir)], check=False, timeout=30)
        agent._tmp.cleanup()
    errors = _error_repeats(log_text)
    repeated = {m: n for m, n in errors.most_common(10) if n > 1}
    lat_ok = [v for v in latencies.values() if v is not None]
    fd_bad = [s for s in samples if s["fds_logs"] > s["max_open_files"] + 1 or s["fds"] >= s["soft_nofile"]]
    criteria = {
        "latency": {"pass": bool(latencies) and len(lat_ok) == len(latencies)
                    and max(lat_ok) <= GOAL_LATENCY_S,
                    "max_s": max(lat_ok) if lat_ok else None, "missed": len(latencies) - len(lat_ok),
                    "after_long_line_s": latencies.get("train"), "n": len(latencies)},
        "rss": {"pass": hwm < GOAL_RSS_MB, "peak_mb": hwm},
        "descriptors": {"pass": not fd_bad and bool(samples), "peak": max((s["fds"] for s in samples), default=0),
                        "peak_on_logs": max((s["fds_logs"] for s in samples), default=0),
                        "over_limit_samples": len(fd_bad)},
        "error_repeats": {"pass": not repeated, "error_lines": sum(errors.values()),
                          "distinct": len(errors), "top_repeated": repeated},
        "ready": {"pass": all(s["ready"] for s in samples), "not_ready_samples":
                  sum(1 for s in samples if not s["ready"])},
        "full_disk": {"simulated": mounted, "why_not": why_no_full_disk, "filled_bytes": filled if mounted else 0},
    }
    return {
        "bench": NAME, "date": common.now_iso(), "quick": quick, "host": common.host_info(),
        "params": {"minutes": minutes, "files": files, "long_line_mb": long_line_mb, "junk": junk,
                   "nan_every_s": nan_every, "state_kb": state_kb, "max_open_files": max_open_files},
        "goal": {"latency_s": GOAL_LATENCY_S, "rss_mb": GOAL_RSS_MB},
        "setup_s": setup_s, "startup_s": agent.startup_s, "exit_code": agent.exit_code,
        "latencies_s": latencies, "samples": samples, "criteria": criteria,
        "errors_total": {k: v for k, v in _errors_by_kind(final).items() if v},
        "passed": all(c["pass"] for c in criteria.values() if "pass" in c),
    }


def _errors_by_kind(text: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(r'^precision_agent_errors_total\{kind="([a-z_]+)"\} (\S+)', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def report(res: dict[str, Any]) -> str:
    p, c = res["params"], res["criteria"]
    lines = [f"soak: {p['minutes']:g} min, {p['files']} log files, a {p['long_line_mb']} MiB line, "
             f"{p['junk']} junk dump files, full state disk "
             f"{'yes' if c['full_disk']['simulated'] else 'NOT simulated: ' + c['full_disk']['why_not']}"
             f"   ({res['date']}, {res['host']['cpus']} CPUs; setup {res['setup_s']:.0f} s, "
             f"agent ready in {res['startup_s']:.1f} s)"]

    def verdict(ok: bool) -> str:
        return "pass" if ok else "FAIL"

    lat = c["latency"]
    mx = "n/a" if lat["max_s"] is None else f"{lat['max_s']:.2f} s"
    after = "n/a" if lat["after_long_line_s"] is None else f"{lat['after_long_line_s']:.2f} s"
    lines.append(f"  latency        {verdict(lat['pass'])}: {lat['n']} NaN(s), max {mx} (goal <= {GOAL_LATENCY_S:g} s),"
                 f" {lat['missed']} missed; the one after the long line {after}")
    lines.append(f"  rss            {verdict(c['rss']['pass'])}: peak {c['rss']['peak_mb']:.1f} MB "
                 f"(goal < {GOAL_RSS_MB:g} MB)")
    d = c["descriptors"]
    lines.append(f"  descriptors    {verdict(d['pass'])}: peak {d['peak']} in all, {d['peak_on_logs']} on logs; "
                 f"{d['over_limit_samples']} sample(s) over the limit")
    e = c["error_repeats"]
    lines.append(f"  error_repeats  {verdict(e['pass'])}: {e['error_lines']} ERROR line(s), {e['distinct']} distinct")
    for msg, n in list(e["top_repeated"].items())[:5]:
        lines.append(f"      {n:6d} x {msg[:150]}")
    lines.append(f"  ready          {verdict(c['ready']['pass'])}: {c['ready']['not_ready_samples']} sample(s) not ready")
    if res["errors_total"]:
        lines.append(f"  errors_total by kind: {res['errors_total']}")
    lines.append(f"  => {'every criterion met' if res['passed'] else 'SOME CRITERIA FAILED'}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=None, help="how long (default 10, quick 1)")
    p.add_argument("--files", type=int, default=None, help="idle log files (default 10000, quick 1000)")
    p.add_argument("--long-line-mb", type=int, default=None, help="the over-long line, MiB (default 200, quick 32)")
    p.add_argument("--junk", type=int, default=None, help="junk dump files (default 50000, quick 5000)")
    p.add_argument("--nan-every", type=float, default=None, help="seconds between NaNs (default 10, quick 5)")
    p.add_argument("--state-kb", type=int, default=4096, help="size of the state tmpfs, KiB (default 4096)")
    p.add_argument("--max-open-files", type=int, default=None, help="limits.max_open_files (default: agent's)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a criterion fails")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick

    def pick(v: Any, full: Any, small: Any) -> Any:
        return v if v is not None else (small if q else full)

    return run(minutes=pick(args.minutes, 10.0, 1.0), files=pick(args.files, 10_000, 1000),
               long_line_mb=pick(args.long_line_mb, 200, 32), junk=pick(args.junk, 50_000, 5000),
               nan_every=pick(args.nan_every, 10.0, 5.0), state_kb=args.state_kb,
               max_open_files=args.max_open_files, quick=q)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--results-dir", type=Path, default=None)
    add_arguments(p)
    args = p.parse_args(argv)
    res = run_from_args(args)
    path = common.write_result(NAME, res, args.results_dir)
    print(report(res))
    print(f"  (written to {path})")
    return 1 if args.strict and not res["passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
