"""Dump-comparison throughput: ``compare_arrays`` over two fp32 arrays (256 MiB each by default)
against numpy's ``a.sum() + b.sum()`` over the same two arrays, in the same run (goal ratio >= 0.3).

Two pairs: *identical* (a rerun that reproduced bit for bit: the bitwise fast path) and
*different* (every element off by ~1e-3 relative: every metric and KLD, which needs both sides'
ranges: numpy and the kernel on halves take a min/max pre-pass first, the kernel on fp32 finds
them in its pass 1 and re-reads for KLD's terms in pass 2); then the different pair as fp16 and as bfloat16 (NPU dumps' usual dtypes). Every compare
runs on the compiled kernel (agent/kernels/compare.c, when built) and on the numpy kernels,
interleaved in the same rounds, so the two paths are compared under the same load. Each round
times the sum, then the compares, so they share the host's conditions; best of N by wall time
and, separately, by CPU time of this process (steadier on a shared host, where another job can
take the core mid-run). The traced peak of Python/numpy allocations
during a compare shows the working memory is block-sized, whatever the array size.

``--ops`` adds where the time goes: each numpy pass the different pair makes per block, timed
alone on block-sized buffers (CPU ns per element), times how often it runs per element pair.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from typing import Any, Callable

import numpy as np

from . import common

GOAL_RATIO = 0.3
# the differing fp32 pair on each x86-64 variant, forced (issue 12); every variant above numpy
GOAL_VARIANT = {"avx512": 0.25, "avx2": 0.2}


def _best(fns: dict[str, Callable[[], Any]], repeat: int) -> tuple[dict[str, float], dict[str, float]]:
    """Best wall and best CPU seconds of each function, the functions interleaved per round."""
    wall = {k: float("inf") for k in fns}
    cpu = dict(wall)
    for _ in range(repeat):
        for k, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[k] = min(wall[k], time.perf_counter() - t)
            cpu[k] = min(cpu[k], time.process_time() - c)
    return wall, cpu


def op_table(a: np.ndarray, b: np.ndarray, block: int, repeat: int = 7) -> list[dict[str, Any]]:
    """CPU ns per element of each kind of pass a different block makes (in cache, one block),
    and how many of it one element pair costs in ``compare_arrays`` (see kernels/compare_numpy.py)."""
    from precision_agent.kernels.compare_numpy import dot

    m = min(block, a.size)
    xr, yr = np.ascontiguousarray(a[:m]), np.ascontiguousarray(b[:m])
    x, y, z = xr.astype(np.float64), yr.astype(np.float64), np.empty(m)
    d = np.abs(x - y)
    r = d / np.abs(y)
    b1, b2 = np.empty(m, np.bool_), np.empty(m, np.bool_)
    u64x, u64y = xr.view(np.uint64), yr.view(np.uint64)
    ops: list[tuple[str, float, Callable[[], Any]]] = [
        ("pre-pass min or max of raw float32", 4, lambda: np.minimum.reduce(xr)),
        ("bitwise check (8-byte words !=, any), per pair", 1,
         lambda: np.not_equal(u64x, u64y, out=b1[:m // 2]).any()),
        ("widen float32 -> float64", 2, lambda: np.copyto(z, xr)),
        ("sum (add.reduce float64)", 4, lambda: np.add.reduce(x)),
        ("sum of products (vecdot, rows of 8192)", 5, lambda: dot(x, y)),
        ("not_equal raw float32 -> bool", 1, lambda: np.not_equal(xr, yr, out=b1)),
        ("compare float64 with a scalar -> bool", 4, lambda: np.less(r, 0.001, out=b1)),
        ("bool and", 1, lambda: np.logical_and(b1, b2, out=b2)),
        ("count_nonzero(bool)", 4, lambda: np.count_nonzero(b1)),
        ("subtract array - array", 1, lambda: np.subtract(x, y, out=z)),
        ("subtract scalar", 2, lambda: np.subtract(x, 0.5, out=z)),
        ("abs", 2, lambda: np.abs(x, out=z)),
        ("max (maximum.reduce)", 2, lambda: np.maximum.reduce(d)),
        ("divide", 2, lambda: np.divide(d, y, out=z)),
        ("log float64", 1, lambda: np.log(d, out=z)),
    ]
    rows = []
    with np.errstate(all="ignore"):
        for name, per_pair, fn in ops:
            best = float("inf")
            for _ in range(repeat):
                c = time.process_time()
                for _ in range(20):
                    fn()
                best = min(best, (time.process_time() - c) / 20)
            ns = best / m * 1e9
            rows.append({"op": name, "ns_per_element": ns, "per_pair": per_pair, "ns_per_pair": ns * per_pair})
    return rows


def _paths() -> list[str]:
    """The kernels to time, the default first: "c" (the variant this CPU picks), then each other
    variant it can run ("c-avx2", "c-baseline": what hosts without AVX-512 run), "numpy"."""
    from precision_agent import kernels
    if not kernels.built("compare"):
        return ["numpy"]
    return ["c", *(f"c-{v}" for v in kernels.variants() if v != kernels.variant("compare")), "numpy"]


def _variant() -> str | None:
    from precision_agent import kernels
    return kernels.variant("compare")


def _in(path: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with the block kernels of ``path`` (see :func:`_paths`)."""
    import contextlib

    from precision_agent import kernels
    mode, _, variant = path.partition("-")

    def call() -> Any:
        with kernels.forced(mode), (kernels.forced_variant(variant) if variant else contextlib.nullcontext()):
            return fn()
    return call


def run(size_mib: int = 256, repeat: int = 3, block: int | None = None, ops: bool = False) -> dict[str, Any]:
    from precision_agent.kernels.compare_numpy import drop_scratch
    from precision_agent.compare.metrics import DEFAULT_BLOCK, compare_arrays

    block = block or DEFAULT_BLOCK
    n = size_mib * (1 << 20) // 4
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n, dtype=np.float32)
    same = a.copy()
    b = a + rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    paths = _paths()   # the first is what runs by default (keys without a suffix)
    fns: dict[str, Callable[[], Any]] = {"sum": lambda: (a.sum(), b.sum())}
    for k in paths:
        fns[f"identical_{k}"] = _in(k, lambda: compare_arrays(a, same, block_elems=block))
        fns[f"different_{k}"] = _in(k, lambda: compare_arrays(a, b, block_elems=block))
    wall, cpu = _best(fns, repeat)
    del same
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    abf, bbf = ((v.view(np.uint32) >> 16).astype(np.uint16) for v in (a, b))   # truncated bfloat16
    hfns: dict[str, Callable[[], Any]] = {}
    for k in paths:
        hfns[f"different_fp16_{k}"] = _in(k, lambda: compare_arrays(a16, b16, block_elems=block))
        hfns[f"different_bf16_{k}"] = _in(k, lambda: compare_arrays(
            abf, bbf, target_dtype="bfloat16", bench_dtype="bfloat16", block_elems=block))
    hw, hc = _best(hfns, repeat)
    wall.update(hw)
    cpu.update(hc)
    del a16, b16, abf, bbf
    for t in (wall, cpu):   # the default path under the historical names
        for name in ("identical", "different", "different_fp16", "different_bf16"):
            t[name] = t[f"{name}_{paths[0]}"]
    drop_scratch()   # the block buffers are kept between compares: count them in the peak
    tracemalloc.start()
    d = _in(paths[0], lambda: compare_arrays(a, b, block_elems=block))()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    res: dict[str, Any] = {
        "bench": "compare", "date": common.now_iso(), "host": common.host_info(),
        "params": {"size_mib": size_mib, "elements": n, "repeat": repeat, "block_elems": block,
                   "kernels": paths, "variant": _variant()},
        "goal": {"ratio": GOAL_RATIO},
        "sum_s": wall["sum"], "sum_gb_per_s": 2 * n * 4 / wall["sum"] / 1e9,
        "identical_s": wall["identical"], "different_s": wall["different"],
        "cpu_s": cpu,
        "ns_per_pair": {k: v / n * 1e9 for k, v in wall.items()},
        "different_cosine": d.metrics["CosineSimilarity"], "different_kld": d.metrics["KullbackLeiblerDivergence"],
        "peak_traced_bytes": peak,
        "ratios": {"identical_to_sum": wall["sum"] / wall["identical"],
                   "different_to_sum": wall["sum"] / wall["different"]},
        "cpu_ratios": {"identical_to_sum": cpu["sum"] / max(cpu["identical"], 1e-9),
                       "different_to_sum": cpu["sum"] / max(cpu["different"], 1e-9)},
        # 16-bit dumps (NPU side): same element count, against the same fp32 sum per element
        "half_ratios": {k: wall["sum"] / wall[k] for k in ("different_fp16", "different_bf16")},
        "by_kernel": {k: {name: wall["sum"] / wall[f"{name}_{k}"] for name in
                          ("identical", "different", "different_fp16", "different_bf16")} for k in paths},
    }
    if ops:
        res["ops"] = op_table(a, b, block)
    return res


def report(res: dict[str, Any]) -> str:
    p, r, c, ns = res["params"], res["ratios"], res["cpu_ratios"], res["ns_per_pair"]

    def verdict(v: float) -> str:
        return "within goal" if v >= GOAL_RATIO else "BELOW GOAL"

    lines = [
        f"compare: two {p['size_mib']} MiB fp32 arrays, block {p['block_elems']} elements, best of {p['repeat']}, "
        f"kernels {'/'.join(p.get('kernels', ['numpy']))} (the first is the default, reported first; "
        f"c runs its {p.get('variant')} variant)",
        f"  a.sum() + b.sum() {res['sum_s']:.3f} s ({res['sum_gb_per_s']:.1f} GB/s over both, "
        f"{ns['sum']:.2f} ns per element pair)",
        f"  identical pair (bitwise fast path): {res['identical_s']:.3f} s ({ns['identical']:.2f} ns/pair), "
        f"throughput / sum: {r['identical_to_sum']:.3f} (goal >= {GOAL_RATIO}: {verdict(r['identical_to_sum'])}); "
        f"by CPU time {c['identical_to_sum']:.3f}",
        f"  different pair (all metrics, two passes): {res['different_s']:.3f} s ({ns['different']:.2f} ns/pair), "
        f"throughput / sum: {r['different_to_sum']:.3f} (goal >= {GOAL_RATIO}: {verdict(r['different_to_sum'])}); "
        f"by CPU time {c['different_to_sum']:.3f}",
        f"  different fp16 / bf16 pairs (same elements): {ns['different_fp16']:.2f} / "
        f"{ns['different_bf16']:.2f} ns/pair, per element vs the fp32 sum: "
        f"{res['half_ratios']['different_fp16']:.3f} / {res['half_ratios']['different_bf16']:.3f}",
        f"  traced peak allocation during a compare: {res['peak_traced_bytes'] / common.MB:.2f} MB",
    ]
    by = res.get("by_kernel", {})
    for k, rs in by.items():
        v = p.get("variant") if k == "c" else k.partition("-")[2]
        goal = GOAL_VARIANT.get(v or "")
        note = ""
        if goal:
            note += f"; {v} goal >= {goal}: {'within goal' if rs['different'] >= goal else 'BELOW GOAL'}"
        if k != "numpy" and "numpy" in by:
            note += "; faster than numpy" if rs["different"] > by["numpy"]["different"] else "; SLOWER than numpy"
        lines.append(f"  {k:10s} kernels, throughput / sum (same rounds): identical {rs['identical']:.3f}, "
                     f"different {rs['different']:.3f}, fp16 {rs['different_fp16']:.3f}, "
                     f"bf16 {rs['different_bf16']:.3f}{note}")
    if "ops" in res:
        lines.append("  where a different pair's time goes (each pass alone, in cache, CPU ns):")
        lines.append(f"    {'pass':48s} {'ns/elem':>8s} {'x per pair':>10s} {'ns/pair':>8s}")
        for o in res["ops"]:
            lines.append(f"    {o['op']:48s} {o['ns_per_element']:8.3f} {o['per_pair']:10g} {o['ns_per_pair']:8.3f}")
        total = sum(o["ns_per_pair"] for o in res["ops"])
        mem = 2 * res["cpu_s"]["sum"] / p["elements"] * 1e9
        # the passes above are the numpy kernels': compare them with the numpy path's own time
        measured = res["cpu_s"].get("different_numpy", res["cpu_s"]["different"]) / p["elements"] * 1e9
        lines.append(f"    {'passes in cache, total':48s} {'':8s} {'':10s} {total:8.3f}")
        lines.append(f"    {'+ two reads of both arrays (2 x sum time)':48s} {'':8s} {'':10s} {mem:8.3f}")
        lines.append(f"    {'measured, numpy kernels (CPU)':48s} {'':8s} {'':10s} {measured:8.3f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=None, help="size of each fp32 array (default 256, quick 16)")
    p.add_argument("--repeat", type=int, default=None, help="best of N (default 5, quick 1)")
    p.add_argument("--block", type=int, default=None, help="compare block_elems (default: the module's)")
    p.add_argument("--ops", action="store_true", help="also time each numpy pass alone (where the time goes)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(size_mib=args.size_mib or (16 if q else 256), repeat=args.repeat or (1 if q else 5),
               block=args.block, ops=args.ops)


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], "compare", argv)


if __name__ == "__main__":
    raise SystemExit(main())
