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
it in the same rounds, with their own ratios.
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

_CHILD = r"""
import json, sys, time
from precision_agent.dumps.scanner import scan_file_npy
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
                 "peak_rss_mb": GOAL_PEAK_RSS_MB},
        "loadavg_1min": [load_before, load_after],
        "sum_s": wall["sum"], "sum_gb_per_s": n * 4 / wall["sum"] / 1e9,
        "scan_f32_s": wall["f32"], "scan_f16_s": wall["f16"], "scan_bf16_s": wall["bf16"], "naive_f32_s": t_naive,
        "file_scan_s": child["scan_s"], "peak_rss_bytes": child["hwm_bytes"], "peak_rss_mb": peak_mb,
        # the real command, as a user or the daemon's scan thread reads a dump (goal < 300 MB)
        "cli": {"written": {**cli, "peak_rss_mb": cli["peak_rss_bytes"] / common.MB},
                "sparse": {**cli_sparse, "peak_rss_mb": cli_sparse["peak_rss_bytes"] / common.MB}},
        "ratios": ratios,
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


def report(res: dict[str, Any]) -> str:
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
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=None, help="fp32 array size (default 1024, quick 64)")
    p.add_argument("--file-mib", type=int, default=None, help=".npy file size (default 4096, quick 128)")
    p.add_argument("--repeat", type=int, default=None, help="best of N (default 5, quick 1)")
    p.add_argument("--block", type=int, default=None, help="scanner block_elems (default: scanner's)")
    p.add_argument("--threads", type=int, default=None,
                   help="workers of the parallel run (default min(2, CPUs); the first run uses 1)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(size_mib=args.size_mib or (64 if q else 1024), file_mib=args.file_mib or (128 if q else 4096),
               repeat=args.repeat or (1 if q else 5), block=args.block, threads=args.threads)


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], "scan", argv)


if __name__ == "__main__":
    raise SystemExit(main())
