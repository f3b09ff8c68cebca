"""Dump-scanner throughput and memory: ``scan_array`` over a 1 GiB fp32 array against numpy's
``a.sum()`` over the same array (goal ratio >= 0.5), fp16 and bf16 (raw uint16 words) in bytes/s
against the same fp32 ``a.sum()`` bandwidth (goal >= 0.25), and the peak RSS of a subprocess
scanning a 4 GiB .npy file through ``scan_file_npy`` (goal < 300 MB). A naive
isnan/isinf/min/max/mean sequence is reported for context. Everything is measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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


def run(size_mib: int = 1024, file_mib: int = 4096, repeat: int = 3, block: int | None = None) -> dict[str, Any]:
    from precision_agent.dumps.scanner import DEFAULT_BLOCK, scan_array

    block = block or DEFAULT_BLOCK
    n = size_mib * (1 << 20) // 4
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n, dtype=np.float32)
    t_sum = common.best_of(lambda: a.sum(), repeat)
    t_f32 = common.best_of(lambda: scan_array(a, block_elems=block), repeat)
    t_naive = common.best_of(lambda: _naive(a), max(1, repeat - 1))
    h = a.astype(np.float16)
    t_f16 = common.best_of(lambda: scan_array(h, block_elems=block), repeat)
    del h
    w = (a.view(np.uint32) >> 16).astype(np.uint16)
    t_bf16 = common.best_of(lambda: scan_array(w, dtype="bfloat16", block_elems=block), repeat)
    del w, a
    sum_bw = n * 4 / t_sum
    with tempfile.TemporaryDirectory(prefix="pa-scan-") as tmp:
        path = Path(tmp) / "big.npy"
        _write_npy(path, file_mib * (1 << 20))
        fsize = path.stat().st_size
        child = _rss_child(path, block)
    peak_mb = child["hwm_bytes"] / common.MB
    return {
        "bench": "scan", "date": common.now_iso(), "host": common.host_info(),
        "params": {"size_mib": size_mib, "file_mib": file_mib, "file_bytes": fsize, "repeat": repeat,
                   "block_elems": block},
        "goal": {"f32_ratio": GOAL_F32_RATIO, "half_bytes_ratio": GOAL_HALF_BYTES_RATIO,
                 "peak_rss_mb": GOAL_PEAK_RSS_MB},
        "sum_s": t_sum, "sum_gb_per_s": sum_bw / 1e9,
        "scan_f32_s": t_f32, "scan_f16_s": t_f16, "scan_bf16_s": t_bf16, "naive_f32_s": t_naive,
        "file_scan_s": child["scan_s"], "peak_rss_bytes": child["hwm_bytes"], "peak_rss_mb": peak_mb,
        "ratios": {"f32_to_sum": t_sum / t_f32, "naive_to_sum": t_sum / t_naive,
                   "f16_bytes_to_sum": (n * 2 / t_f16) / sum_bw, "bf16_bytes_to_sum": (n * 2 / t_bf16) / sum_bw,
                   "peak_rss_to_goal": peak_mb / GOAL_PEAK_RSS_MB},
    }


def report(res: dict[str, Any]) -> str:
    p, r = res["params"], res["ratios"]

    def verdict(v: float, goal: float) -> str:
        return "within goal" if v >= goal else "BELOW GOAL"

    return "\n".join([
        f"scan: {p['size_mib']} MiB fp32 array, block {p['block_elems']} elements, best of {p['repeat']}",
        f"  a.sum() {res['sum_s']:.3f} s ({res['sum_gb_per_s']:.1f} GB/s); scan_array {res['scan_f32_s']:.3f} s",
        f"  fp32 scan / a.sum() throughput: {r['f32_to_sum']:.3f} (goal >= {GOAL_F32_RATIO}: "
        f"{verdict(r['f32_to_sum'], GOAL_F32_RATIO)}); naive isnan/isinf/min/max/mean: {r['naive_to_sum']:.3f}",
        f"  fp16 bytes/s / fp32 a.sum() bytes/s: {r['f16_bytes_to_sum']:.3f} (goal >= {GOAL_HALF_BYTES_RATIO}: "
        f"{verdict(r['f16_bytes_to_sum'], GOAL_HALF_BYTES_RATIO)})",
        f"  bf16 bytes/s / fp32 a.sum() bytes/s: {r['bf16_bytes_to_sum']:.3f} (goal >= {GOAL_HALF_BYTES_RATIO}: "
        f"{verdict(r['bf16_bytes_to_sum'], GOAL_HALF_BYTES_RATIO)})",
        f"  scan_file_npy of a {p['file_bytes'] / 1e9:.2f} GB .npy in a subprocess: {res['file_scan_s']:.2f} s, "
        f"peak RSS {common.ratio_text(res['peak_rss_mb'], GOAL_PEAK_RSS_MB, ' MB')}",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=None, help="fp32 array size (default 1024, quick 64)")
    p.add_argument("--file-mib", type=int, default=None, help=".npy file size (default 4096, quick 128)")
    p.add_argument("--repeat", type=int, default=None, help="best of N (default 3, quick 1)")
    p.add_argument("--block", type=int, default=None, help="scanner block_elems (default: scanner's)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(size_mib=args.size_mib or (64 if q else 1024), file_mib=args.file_mib or (128 if q else 4096),
               repeat=args.repeat or (1 if q else 3), block=args.block)


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], "scan", argv)


if __name__ == "__main__":
    raise SystemExit(main())
