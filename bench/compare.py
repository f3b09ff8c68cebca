"""Dump-comparison throughput: ``compare_arrays`` over two fp32 arrays (256 MiB each by default)
against numpy's ``a.sum() + b.sum()`` over the same two arrays, in the same run (goal ratio >= 0.3).

Two pairs: *identical* (a rerun that reproduced bit for bit: the bitwise fast path) and
*different* (every element off by ~1e-3 relative: all metrics, plus the KLD second pass). The
traced peak of Python/numpy allocations during a compare shows the working memory is
block-sized, whatever the array size.
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from typing import Any

import numpy as np

from . import common

GOAL_RATIO = 0.3


def run(size_mib: int = 256, repeat: int = 3, block: int | None = None) -> dict[str, Any]:
    from precision_agent.compare.metrics import DEFAULT_BLOCK, compare_arrays

    block = block or DEFAULT_BLOCK
    n = size_mib * (1 << 20) // 4
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n, dtype=np.float32)
    same = a.copy()
    t_sum = common.best_of(lambda: (a.sum(), same.sum()), repeat)
    t_same = common.best_of(lambda: compare_arrays(a, same, block_elems=block), repeat)
    del same
    b = a + rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    t_sum_b = common.best_of(lambda: (a.sum(), b.sum()), repeat)
    t_diff = common.best_of(lambda: compare_arrays(a, b, block_elems=block), repeat)
    tracemalloc.start()
    d = compare_arrays(a, b, block_elems=block)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    t_sum = min(t_sum, t_sum_b)
    return {
        "bench": "compare", "date": common.now_iso(), "host": common.host_info(),
        "params": {"size_mib": size_mib, "elements": n, "repeat": repeat, "block_elems": block},
        "goal": {"ratio": GOAL_RATIO},
        "sum_s": t_sum, "sum_gb_per_s": 2 * n * 4 / t_sum / 1e9,
        "identical_s": t_same, "different_s": t_diff,
        "different_cosine": d.metrics["CosineSimilarity"], "different_kld": d.metrics["KullbackLeiblerDivergence"],
        "peak_traced_bytes": peak,
        "ratios": {"identical_to_sum": t_sum / t_same, "different_to_sum": t_sum / t_diff},
    }


def report(res: dict[str, Any]) -> str:
    p, r = res["params"], res["ratios"]

    def verdict(v: float) -> str:
        return "within goal" if v >= GOAL_RATIO else "BELOW GOAL"

    return "\n".join([
        f"compare: two {p['size_mib']} MiB fp32 arrays, block {p['block_elems']} elements, best of {p['repeat']}",
        f"  a.sum() + b.sum() {res['sum_s']:.3f} s ({res['sum_gb_per_s']:.1f} GB/s over both)",
        f"  identical pair (bitwise fast path): {res['identical_s']:.3f} s, throughput / sum: "
        f"{r['identical_to_sum']:.3f} (goal >= {GOAL_RATIO}: {verdict(r['identical_to_sum'])})",
        f"  different pair (all metrics + KLD pass): {res['different_s']:.3f} s, throughput / sum: "
        f"{r['different_to_sum']:.3f} (goal >= {GOAL_RATIO}: {verdict(r['different_to_sum'])})",
        f"  traced peak allocation during a compare: {res['peak_traced_bytes'] / common.MB:.2f} MB",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=None, help="size of each fp32 array (default 256, quick 16)")
    p.add_argument("--repeat", type=int, default=None, help="best of N (default 3, quick 1)")
    p.add_argument("--block", type=int, default=None, help="compare block_elems (default: the module's)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(size_mib=args.size_mib or (16 if q else 256), repeat=args.repeat or (1 if q else 3),
               block=args.block)


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], "compare", argv)


if __name__ == "__main__":
    raise SystemExit(main())
