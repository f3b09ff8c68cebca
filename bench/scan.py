"""Dump-scanner throughput and memory: ``scan_array`` over a 1 GiB fp32 array against numpy's
``a.sum()`` over the same array (goal ratio >= 0.5), fp16 and bf16 (raw uint16 words) in bytes/s
against the same fp32 ``a.sum()`` bandwidth (goal >= 0.25), and the peak RSS of a subprocess
scanning a 4 GiB .npy file through ``scan_file_npy`` and through the real ``precision-agent scan``
command (its VmHWM sampled from /proc/<pid>/status while it runs, and its ``wait4`` maximum RSS at
exit), on the written file and on a sparse one of the same size (goal < 300 MB). A naive
isnan/isinf/min/max/mean sequence is reported for context. Everything is measured in one run:
the scanner with one thread (the agent's default, the headline) and with ``--threads`` workers,
each best of N with all measurements interleaved. The headline runs the kernel that
``PRECISION_AGENT_KERNELS=auto`` picks ("c" where the C kernel is built, else "numpy"); the
numpy kernels, and each other variant of the C loops the CPU runs (forced), are measured beside
it in the same rounds, with their own ratios. And the row users feel (issue 21): the real
``precision-agent scan FILE --json`` of the file, read into the page cache first, against a numpy
``np.load(FILE, mmap_mode="r").sum()``, each a subprocess net of its own start-up, on both read
paths, interleaved, best of N, with peak RSS (``--cli-only`` runs this row alone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import common

GOAL_F32_RATIO = 0.5
GOAL_HALF_BYTES_RATIO = 0.25
GOAL_PEAK_RSS_MB = 300.0
GOAL_CLI_RATIO = 0.8             # scan FILE --json vs numpy mmap sum, net of start-up (issue 21)

_CHILD = r"""
import json, sys, time
from precision_agent.dumps.windows import scan_file_npy
t = time.perf_counter()
s = scan_file_npy(sys.argv[1], block_elems=int(sys.argv[2]))
dt = time.perf_counter() - t
hwm = 0
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
print(json.dumps({"hwm_bytes": hwm, "scan_s": dt, "count": s.count, "nan": s.nan}))
"""


def _naive(a: np.ndarray) -> None:
    np.isnan(a).sum(); np.isinf(a).sum()  # noqa: E702
    a.min(); a.max(); a.mean()  # noqa: E702


def _write_npy(path: Path, nbytes: int) -> None:
    """A float32 .npy of ``nbytes`` data bytes, written in chunks (bounded memory)."""
    n = nbytes // 4
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n,))
    rng = np.random.default_rng(1)
    chunk = 1 << 24
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        mm[i:i + m] = rng.standard_normal(m, dtype=np.float32)
    mm[n // 2] = np.nan
    mm.flush()
    del mm


def _rss_child(path: Path, block: int) -> dict[str, Any]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(block)], capture_output=True,
                         text=True, env=env, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


# Runs a command and reports its peak RSS. The command is forked from this small launcher, not
# from the bench: Linux carries the pre-exec memory high-water mark of a forked child into its
# ``ru_maxrss``, and a fork of the bench (GiBs of arrays) would report the bench's RSS.
_LAUNCH = r"""
import json, os, subprocess, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
hwm, t = 0, time.perf_counter()
while True:
    try:
        with open(f"/proc/{p.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = max(hwm, int(line.split()[1]) * 1024)
    except OSError:
        pass
    pid, status, usage = os.wait4(p.pid, os.WNOHANG)
    if pid:
        break
    time.sleep(0.005)
with open(out, "w") as f:
    json.dump({"scan_s": time.perf_counter() - t, "hwm_sampled_bytes": hwm,
               "peak_rss_bytes": max(hwm, usage.ru_maxrss * 1024), "exit": os.waitstatus_to_exitcode(status)}, f)
"""


def _cli_rss(path: Path) -> dict[str, Any]:
    """Peak RSS of ``precision-agent scan PATH --json`` as ``ps`` sees it: VmHWM sampled from
    /proc/<pid>/status while it runs, and the kernel's maximum RSS of the child at exit."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = path.with_suffix(".rss.json")
    subprocess.run([sys.executable, "-c", _LAUNCH, str(out), sys.executable, "-m", "precision_agent", "scan",
                    str(path), "--json"], env=env, check=True, timeout=1800)
    res = json.loads(out.read_text())
    out.unlink()
    return res


# Runs a command once and reports its wall time and peak RSS (``wait4``: what ``/usr/bin/time``
# reports), started from this small launcher for the reason given above.
_TIMED = r"""
import json, os, subprocess, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
env = dict(os.environ)
if cmd[0] == "--env":
    k, _, v = cmd[1].partition("="); env[k] = v; cmd = cmd[2:]
t = time.perf_counter()
p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
_, status, usage = os.wait4(p.pid, 0)
with open(out, "w") as f:
    json.dump({"s": time.perf_counter() - t, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024,
               "exit": os.waitstatus_to_exitcode(status)}, f)
"""
_NUMPY_SUM = "import sys, numpy as np; np.load(sys.argv[1], mmap_mode='r').sum()"


def _cached(path: Path) -> float:
    """Fraction of ``path``'s pages in the page cache (mincore), touching none."""
    from precision_agent.dumps import pagecache
    fd = os.open(path, os.O_RDONLY)
    try:
        was = pagecache.resident_pages(fd, *pagecache.page_span(0, os.fstat(fd).st_size))
        return float(was.mean()) if was is not None else float("nan")
    finally:
        os.close(fd)


def _warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass


def cli_vs_numpy(path: Path, repeat: int) -> dict[str, Any]:
    """``precision-agent scan FILE --json`` against a numpy mmap sum of the same cached file, each
    a subprocess, net of its own start-up (the same command on a 16-element .npy), interleaved
    round by round, best of ``repeat``; the file is read into the page cache before each run.
    The scan runs on the default read path (pread into a reused buffer) and, beside it, with
    ``PRECISION_AGENT_SCAN_READ=map`` (cached windows scanned in place in a mapping)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    tiny = path.with_name("tiny.npy")
    np.save(tiny, np.zeros(16, np.float32))
    agent = [sys.executable, "-m", "precision_agent", "scan", "{}", "--json"]
    cmds = {"agent": agent, "agent_map": ["--env", "PRECISION_AGENT_SCAN_READ=map", *agent],
            "numpy": [sys.executable, "-c", _NUMPY_SUM, "{}"]}
    best: dict[str, float] = {}
    cpu: dict[str, float] = {}
    rss: dict[str, int] = {}
    cached_after: dict[str, float] = {}
    out = path.with_suffix(".timed.json")
    for _ in range(repeat):
        for who, cmd in cmds.items():
            for f in (tiny, path):
                if f is path:
                    _warm(path)
                subprocess.run([sys.executable, "-c", _TIMED, str(out), *(str(f) if a == "{}" else a for a in cmd)],
                               env=env, check=True, timeout=1800)
                r = json.loads(out.read_text())
                if r["exit"] not in (0, 1):   # scan: 1 = a finding (the planted NaN)
                    raise RuntimeError(f"{who} on {f.name} exited {r['exit']}")
                key = f"{who}_{'big' if f is path else 'tiny'}"
                best[key] = min(best.get(key, float("inf")), r["s"])
                cpu[key] = min(cpu.get(key, float("inf")), r["cpu"])
                rss[key] = max(rss.get(key, 0), r["rss"])
                if f is path:
                    cached_after[who] = _cached(path)
    out.unlink()
    tiny.unlink()
    nbytes = path.stat().st_size
    # both agent runs are the same program on the tiny file: their start-up is one figure, the
    # best of both (start-up varies by tenths of a second on a busy host, more than the read paths)
    for d in (best, cpu):
        d["agent_tiny"] = d["agent_map_tiny"] = min(d["agent_tiny"], d["agent_map_tiny"])
    net = {w: max(1e-9, best[f"{w}_big"] - best[f"{w}_tiny"]) for w in cmds}
    net_cpu = {w: max(1e-9, cpu[f"{w}_big"] - cpu[f"{w}_tiny"]) for w in cmds}
    return {"file_bytes": nbytes, "repeat": repeat, "best_s": best, "net_s": net,
            # CPU time (user + system) of the same runs: steadier than wall time on a busy host
            "best_cpu_s": cpu, "net_cpu_s": net_cpu, "ratio_cpu": net_cpu["numpy"] / net_cpu["agent"],
            "ratio_map_cpu": net_cpu["numpy"] / net_cpu["agent_map"],
            "gb_per_s": {w: nbytes / t / 1e9 for w, t in net.items()},
            "ratio": net["numpy"] / net["agent"], "ratio_map": net["numpy"] / net["agent_map"],
            "peak_rss_mb": {w: rss[f"{w}_big"] / common.MB for w in cmds},
            "cached_after": cached_after}


def _sparse_npy(path: Path, nbytes: int) -> None:
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": (nbytes // 4,)})
        fh.truncate(fh.tell() + nbytes)


def _timed(fns: dict[str, Any], repeat: int) -> tuple[dict[str, float], dict[str, float]]:
    """Best wall time and best CPU time (this process, all threads) of each function, the
    functions interleaved round by round so that a busy moment on a shared machine hits all of
    them alike."""
    wall = {k: float("inf") for k in fns}
    cpu = dict(wall)
    for _ in range(repeat):
        for k, fn in fns.items():
            c = time.process_time()
            wall[k] = min(wall[k], common.best_of(fn, 1))
            cpu[k] = min(cpu[k], time.process_time() - c)
    return wall, cpu


def _ratios(t: dict[str, float], n: int, suffix: str = "") -> dict[str, float]:
    """Throughput ratios to ``a.sum()``: fp32 in elements, fp16/bf16 in bytes (2 vs 4 per element)."""
    s = t["sum"]
    return {"f32_to_sum": s / t["f32" + suffix], "f16_bytes_to_sum": s / t["f16" + suffix] / 2,
            "bf16_bytes_to_sum": s / t["bf16" + suffix] / 2}


def run_cli_only(file_mib: int = 4096, repeat: int = 5) -> dict[str, Any]:
    """Only the row ``scan FILE --json`` vs numpy mmap sum (``--cli-only``)."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="pa-scan-") as tmp:
        path = Path(tmp) / "big.npy"
        _write_npy(path, file_mib * (1 << 20))
        row = cli_vs_numpy(path, repeat)
    return {"bench": "scan", "date": common.now_iso(), "host": common.host_info(),
            "params": {"file_mib": file_mib, "repeat": repeat, "cli_only": True},
            "goal": {"cli_ratio": GOAL_CLI_RATIO, "peak_rss_mb": GOAL_PEAK_RSS_MB},
            "loadavg_1min": [load_before, os.getloadavg()[0]], "cli_vs_numpy": row}


def run(size_mib: int = 1024, file_mib: int = 4096, repeat: int = 5, block: int | None = None,
        threads: int | None = None) -> dict[str, Any]:
    from precision_agent import kernels
    from precision_agent.dumps.scanner import DEFAULT_BLOCK, scan_array

    block = block or DEFAULT_BLOCK
    par = threads or min(2, len(os.sched_getaffinity(0)))
    n = size_mib * (1 << 20) // 4
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n, dtype=np.float32)
    h = a.astype(np.float16)
    w = (a.view(np.uint32) >> 16).astype(np.uint16)
    with kernels.forced("auto"):
        kernel = kernels.active()["scan"]

    # the other variants of the C loops this CPU runs (what hosts without AVX-512 run), forced
    others = [v for v in kernels.variants() if v != kernels.variant("scan")]

    def scan(x: np.ndarray, t: int, mode: str, **kw: Any) -> Any:
        mode, _, variant = mode.partition("-")
        with kernels.forced(mode), (kernels.forced_variant(variant) if variant else contextlib.nullcontext()):
            return scan_array(x, block_elems=block, threads=t, **kw)

    fns: dict[str, Any] = {"sum": lambda: a.sum()}
    for suffix, t, mode in (("", 1, "auto"), ("_par", par, "auto"), ("_np", 1, "numpy"),
                            *((f"_{v}", 1, f"c-{v}") for v in others)):
        if suffix == "_np" and kernel == "numpy":
            continue  # the headline is the numpy path already
        fns["f32" + suffix] = lambda t=t, m=mode: scan(a, t, m)
        fns["f16" + suffix] = lambda t=t, m=mode: scan(h, t, m)
        fns["bf16" + suffix] = lambda t=t, m=mode: scan(w, t, m, dtype="bfloat16")
    load_before = os.getloadavg()[0]
    wall, cpu = _timed(fns, repeat)
    t_naive = common.best_of(lambda: _naive(a), max(1, repeat // 2))
    load_after = os.getloadavg()[0]
    del a, h, w
    with tempfile.TemporaryDirectory(prefix="pa-scan-") as tmp:
        path = Path(tmp) / "big.npy"
        _write_npy(path, file_mib * (1 << 20))
        fsize = path.stat().st_size
        cli_row = cli_vs_numpy(path, repeat)
        child = _rss_child(path, block)
        cli = _cli_rss(path)
        path.unlink()
        _sparse_npy(path, file_mib * (1 << 20))
        cli_sparse = _cli_rss(path)
    peak_mb = child["hwm_bytes"] / common.MB
    ratios = _ratios(wall, n)
    np_suffix = "_np" if "f32_np" in wall else ""
    ratios.update(naive_to_sum=wall["sum"] / t_naive, peak_rss_to_goal=peak_mb / GOAL_PEAK_RSS_MB)
    return {
        "bench": "scan", "date": common.now_iso(), "host": common.host_info(),
        "kernel": kernel,
        "params": {"size_mib": size_mib, "file_mib": file_mib, "file_bytes": fsize, "repeat": repeat,
                   "block_elems": block, "threads": par},
        "goal": {"f32_ratio": GOAL_F32_RATIO, "half_bytes_ratio": GOAL_HALF_BYTES_RATIO,
                 "peak_rss_mb": GOAL_PEAK_RSS_MB, "cli_ratio": GOAL_CLI_RATIO},
        "loadavg_1min": [load_before, load_after],
        "sum_s": wall["sum"], "sum_gb_per_s": n * 4 / wall["sum"] / 1e9,
        "scan_f32_s": wall["f32"], "scan_f16_s": wall["f16"], "scan_bf16_s": wall["bf16"], "naive_f32_s": t_naive,
        "file_scan_s": child["scan_s"], "peak_rss_bytes": child["hwm_bytes"], "peak_rss_mb": peak_mb,
        # the real command, as a user or the daemon's scan thread reads a dump (goal < 300 MB)
        "cli": {"written": {**cli, "peak_rss_mb": cli["peak_rss_bytes"] / common.MB},
                "sparse": {**cli_sparse, "peak_rss_mb": cli_sparse["peak_rss_bytes"] / common.MB}},
        "ratios": ratios,
        # the real command on the cached file vs numpy's mmap sum, net of start-up (goal >= 0.8)
        "cli_vs_numpy": cli_row,
        # the same with ``threads`` workers (wall time), and single-thread ratios of CPU time
        # (insensitive to other processes taking the core away, not to their cache traffic)
        "parallel": {"threads": par, "scan_f32_s": wall["f32_par"], "scan_f16_s": wall["f16_par"],
                     "scan_bf16_s": wall["bf16_par"], "ratios": _ratios(wall, n, "_par")},
        # the numpy kernels in the same rounds (the same numbers as the headline where it is numpy)
        "numpy_path": {"scan_f32_s": wall["f32" + np_suffix], "scan_f16_s": wall["f16" + np_suffix],
                       "scan_bf16_s": wall["bf16" + np_suffix], "ratios": _ratios(wall, n, np_suffix),
                       "cpu_ratios": _ratios(cpu, n, np_suffix)},
        # each other variant of the C loops, forced, in the same rounds
        "variants": {"default": kernels.variant("scan"), **{v: _ratios(wall, n, f"_{v}") for v in others}},
        "cpu_time": {"sum_s": cpu["sum"], "scan_f32_s": cpu["f32"], "scan_f16_s": cpu["f16"],
                     "scan_bf16_s": cpu["bf16"], "ratios": _ratios(cpu, n)},
    }


def _cli_lines(res: dict[str, Any]) -> list[str]:
    c = res.get("cli_vs_numpy")
    if not c:
        return []
    g, net, rss = c["gb_per_s"], c["net_s"], c["peak_rss_mb"]
    verdict = "within goal" if c["ratio"] >= GOAL_CLI_RATIO else "BELOW GOAL"
    return [
        f"  precision-agent scan FILE --json vs numpy mmap sum of a cached {c['file_bytes'] / 1e9:.2f} GB .npy, "
        f"net of start-up, best of {c['repeat']}: {c['ratio']:.3f} (goal >= {GOAL_CLI_RATIO}: {verdict}); "
        f"{g['agent']:.2f} vs {g['numpy']:.2f} GB/s ({net['agent']:.3f} vs {net['numpy']:.3f} s)",
        f"    by CPU time: {c['ratio_cpu']:.3f}; cached windows scanned in place (SCAN_READ=map): "
        f"{c['ratio_map']:.3f} ({g['agent_map']:.2f} GB/s), by CPU time {c['ratio_map_cpu']:.3f}; peak RSS "
        f"{rss['agent']:.0f} MB (map {rss['agent_map']:.0f} MB, numpy {rss['numpy']:.0f} MB); file "
        f"cached after the scan: {c['cached_after']['agent']:.0%}",
    ]


def report(res: dict[str, Any]) -> str:
    if res["params"].get("cli_only"):
        return "\n".join([f"scan (--cli-only; load average {res['loadavg_1min'][0]:.1f} -> "
                          f"{res['loadavg_1min'][1]:.1f})", *_cli_lines(res)])
    p, r = res["params"], res["ratios"]
    par, cpu, npy = res["parallel"], res["cpu_time"]["ratios"], res["numpy_path"]["ratios"]

    def line(label: str, key: str, goal: float) -> str:
        v = r[key]
        verdict = "within goal" if v >= goal else "BELOW GOAL"
        return (f"  {label}: {v:.3f} (goal >= {goal}: {verdict}); by CPU time {cpu[key]:.3f}; "
                f"{par['threads']} threads {par['ratios'][key]:.3f}; numpy kernels {npy[key]:.3f}")

    return "\n".join([
        f"scan: {p['size_mib']} MiB fp32 array, block {p['block_elems']} elements, best of {p['repeat']} "
        f"(load average {res['loadavg_1min'][0]:.1f} -> {res['loadavg_1min'][1]:.1f}); "
        f"kernel: {res['kernel']} (auto), numpy kernels measured beside it",
        f"  a.sum() {res['sum_s']:.3f} s ({res['sum_gb_per_s']:.1f} GB/s); scan_array {res['scan_f32_s']:.3f} s; "
        f"naive isnan/isinf/min/max/mean: ratio {r['naive_to_sum']:.3f}",
        line("fp32 scan / a.sum() throughput", "f32_to_sum", GOAL_F32_RATIO),
        line("fp16 bytes/s / fp32 a.sum() bytes/s", "f16_bytes_to_sum", GOAL_HALF_BYTES_RATIO),
        line("bf16 bytes/s / fp32 a.sum() bytes/s", "bf16_bytes_to_sum", GOAL_HALF_BYTES_RATIO),
        *(f"  C variant {v} forced: fp32 {vr['f32_to_sum']:.3f}, fp16 bytes {vr['f16_bytes_to_sum']:.3f}, "
          f"bf16 bytes {vr['bf16_bytes_to_sum']:.3f} (default variant: {res['variants']['default']})"
          for v, vr in res.get("variants", {}).items() if v != "default"),
        f"  scan_file_npy of a {p['file_bytes'] / 1e9:.2f} GB .npy in a subprocess: {res['file_scan_s']:.2f} s, "
        f"peak RSS {common.ratio_text(res['peak_rss_mb'], GOAL_PEAK_RSS_MB, ' MB')}",
        *(f"  precision-agent scan of the {what} {p['file_bytes'] / 1e9:.2f} GB .npy: {c['scan_s']:.2f} s, "
          f"peak RSS {common.ratio_text(c['peak_rss_mb'], GOAL_PEAK_RSS_MB, ' MB')}"
          for what, c in res.get("cli", {}).items()),
        *_cli_lines(res),
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=None, help="fp32 array size (default 1024, quick 64)")
    p.add_argument("--file-mib", type=int, default=None, help=".npy file size (default 4096, quick 128)")
    p.add_argument("--repeat", type=int, default=None, help="best of N (default 5, quick 1)")
    p.add_argument("--block", type=int, default=None, help="scanner block_elems (default: scanner's)")
    p.add_argument("--cli-only", action="store_true",
                   help="only the row scan FILE --json vs numpy mmap sum (no array benchmarks)")
    p.add_argument("--threads", type=int, default=None,
                   help="workers of the parallel run (default min(2, CPUs); the first run uses 1)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    if args.cli_only:
        return run_cli_only(file_mib=args.file_mib or (128 if q else 4096), repeat=args.repeat or (1 if q else 5))
    return run(size_mib=args.size_mib or (64 if q else 1024), file_mib=args.file_mib or (128 if q else 4096),
               repeat=args.repeat or (1 if q else 5), block=args.block, threads=args.threads)


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], "scan", argv)


if __name__ == "__main__":
    raise SystemExit(main())
