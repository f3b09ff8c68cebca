"""Scanning a tree of many dump files on several cores: ``precision-agent scan TREE --json --jobs N``
(the real command, a subprocess) over a tree of ``ranks`` x ``files`` fp32 ``.npy`` files of
``file_mib`` MiB each (default 8 x 4 x 128 MiB) against N numpy processes summing the same files
(``np.load(f, mmap_mode="r").sum()``, the files dealt round-robin), goal >= 0.8 of their speed on a
2-core host with N = 2 (>= 0.5 on a 16-core host with N = 8). The same command with ``--jobs 1``
(one file after the other) is measured beside them, and the two designs a parallel scan can take
are measured in this process, without start-up: ``scan_dump(jobs=N)`` (threads, what ``--jobs``
runs) and a pool of N forked processes each scanning one rank's folder (start-up and pickling
included); and the numpy kernels (the fallback without a compiler) with N threads and with one. Every measurement is taken with the files in the page cache (a dump just written is;
the scan drops the pages it read, so each run is preceded by an untimed read of the tree), best
of ``repeat``, all of them interleaved round by round. Start-up (the command scanning one tiny
file; N processes importing numpy) is measured in the same rounds, and the ratios are given both
gross (as a user runs them) and net of start-up. The command's output is checked to be the same
for ``--jobs 1`` and ``--jobs N``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import common
from .cliphases import PHASES, best, cli_phases, report_line

GOAL_2CORE = 0.8    # --jobs 2 vs 2 numpy processes, on a 2-core host
GOAL_MANY = 0.5     # --jobs 8 vs 8 numpy processes, on a 16-core host
_SUM = "import sys\nimport numpy as np\nfor f in sys.argv[1:]:\n    np.load(f, mmap_mode='r').sum()\n"
_IMPORT = "import numpy\n"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def make_tree(root: Path, ranks: int, files: int, file_mib: int) -> list[Path]:
    """``ranks`` folders of ``files`` fp32 .npy files each (distinct data per file, one NaN in the
    last rank's last file, so the scan has a first bad op to name)."""
    out = []
    n = file_mib * (1 << 20) // 4
    rng = np.random.default_rng(7)
    base = rng.standard_normal(min(n, 1 << 22), dtype=np.float32)
    for r in range(ranks):
        d = root / f"rank{r}"
        d.mkdir(parents=True)
        for k in range(files):
            p = d / f"layer{k}.output.0.npy"
            mm = np.lib.format.open_memmap(p, mode="w+", dtype=np.float32, shape=(n,))
            for i in range(0, n, base.size):
                m = min(base.size, n - i)
                mm[i:i + m] = base[:m] * np.float32(1 + r + k / 8)
            if r == ranks - 1 and k == files - 1:
                mm[n // 3] = np.nan
            mm.flush()
            del mm
            out.append(p)
    return out


def _warm(paths: list[Path]) -> None:
    """Read every file once (untimed): the pages are in the page cache, as a dump just written is."""
    buf = bytearray(8 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _procs(cmds: list[list[str]]) -> None:
    ps = [subprocess.Popen(c, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in cmds]
    for p in ps:
        p.wait()


def _scan_rank(folder: str) -> dict[str, Any]:
    from precision_agent.dumps.scan import scan_dump
    return scan_dump(Path(folder), drop_cache=False)


def _timed(fns: dict[str, Callable[[], Any]], paths: list[Path], repeat: int,
           ) -> tuple[dict[str, float], dict[str, float]]:
    """Best wall time and the CPU time of that run (this process and its children) of each
    function, the tree read into the page cache before each, all interleaved round by round."""
    wall = {k: float("inf") for k in fns}
    cpu = {k: 0.0 for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            _warm(paths)
            c = time.process_time() + _children_cpu()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if dt < wall[k]:
                wall[k], cpu[k] = dt, time.process_time() + _children_cpu() - c
    return wall, cpu


def run(ranks: int = 8, files: int = 4, file_mib: int = 128, jobs: int | None = None,
        repeat: int = 3) -> dict[str, Any]:
    from precision_agent import kernels
    from precision_agent.dumps.scan import scan_dump
    n = jobs or min(8, len(os.sched_getaffinity(0)))
    cli = [sys.executable, "-m", "precision_agent", "scan", "--json"]
    with tempfile.TemporaryDirectory(prefix="pa-scantree-") as tmp:
        root = Path(tmp) / "tree"
        paths = make_tree(root, ranks, files, file_mib)
        tiny = Path(tmp) / "tiny.npy"
        np.save(tiny, np.ones(4, np.float32))
        outs: dict[int, bytes] = {}
        codes: dict[int, int] = {}

        def command(j: int) -> None:
            p = subprocess.run([*cli, "--jobs", str(j), str(root)], env=_env(), capture_output=True, timeout=1800)
            # the suspect verdict says when it judged: the one clock in the output
            outs[j], codes[j] = re.sub(rb'"judged_at": [0-9.e+]+', b'"judged_at": 0', p.stdout), p.returncode

        folders = [str(root / f"rank{r}") for r in range(ranks)]

        def numpy_threads() -> None:   # N numpy sums at once in this process: the reference without start-up
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(lambda f: np.load(f, mmap_mode="r").sum(), paths))

        def numpy_kernels(j: int) -> None:   # the fallback where no compiler was at install
            with kernels.forced("numpy"):
                scan_dump(root, drop_cache=False, jobs=j)

        def forked() -> None:
            with ProcessPoolExecutor(n, mp_context=get_context("fork")) as ex:
                list(ex.map(_scan_rank, folders))

        fns: dict[str, Callable[[], Any]] = {
            "cli_jobs1": lambda: command(1),
            "cli_jobsN": lambda: command(n),
            "numpy_procs": lambda: _procs([[sys.executable, "-c", _SUM, *map(str, paths[k::n])] for k in range(n)]),
            "threads_inproc": lambda: scan_dump(root, drop_cache=False, jobs=n),
            "numpy_threads_inproc": numpy_threads,
            "procs_inproc": forked,
            "threads1_inproc": lambda: scan_dump(root, drop_cache=False, jobs=1),
            "numpy_kernels_inproc": lambda: numpy_kernels(n),
            "numpy_kernels1_inproc": lambda: numpy_kernels(1),
            "cli_startup": lambda: _procs([[*cli, "--jobs", "1", str(tiny)]]),
            "numpy_startup": lambda: _procs([[sys.executable, "-c", _IMPORT] for _ in range(n)]),
        }
        load_before = os.getloadavg()[0]
        wall, cpu = _timed(fns, paths, repeat)
        # the command's own phases (bench/cliphases.py), the tree and the tiny file alternated
        runs: dict[str, list[dict[str, Any]]] = {"tree": [], "tiny": []}
        for _ in range(repeat):
            _warm(paths)
            runs["tree"].append(cli_phases(sys.executable, ["scan", "--json", "--jobs", str(n), str(root)], _env()))
            runs["tiny"].append(cli_phases(sys.executable, ["scan", "--json", "--jobs", "1", str(tiny)], _env()))
        phases = {k: best(v) for k, v in runs.items()}
        load_after = os.getloadavg()[0]
    same = outs.get(1) == outs.get(n) and codes.get(1) == codes.get(n)
    result = json.loads(outs[n]) if outs.get(n) else {}
    nbytes = ranks * files * file_mib * (1 << 20)
    net = {k: wall[k] - wall["cli_startup"] for k in ("cli_jobs1", "cli_jobsN")}
    np_net = wall["numpy_procs"] - wall["numpy_startup"]

    def net_ratio(scan_s: float) -> float | None:   # None where start-up swamps the work (a tiny tree)
        return np_net / scan_s if scan_s > 0 and np_net > 0 else None

    def cpu_ratio(scan_cpu: float) -> float | None:
        work, np_work = scan_cpu - cpu["cli_startup"], cpu["numpy_procs"] - cpu["numpy_startup"]
        return np_work / work if work > 0 and np_work > 0 else None
    return {
        "bench": "scantree", "date": common.now_iso(), "host": common.host_info(),
        "params": {"ranks": ranks, "files": files, "file_mib": file_mib, "bytes": nbytes, "jobs": n,
                   "repeat": repeat},
        "goal": {"ratio_2core": GOAL_2CORE, "ratio_many_core": GOAL_MANY},
        "loadavg_1min": [load_before, load_after],
        "wall_s": wall, "cpu_s": cpu,
        # CPU time / wall time of the best run: above 1 means more than one core was used at once
        "cores_used": {k: cpu[k] / wall[k] for k in wall},
        "gb_per_s": {k: nbytes / wall[k] / 1e9 for k in ("cli_jobs1", "cli_jobsN", "numpy_procs",
                                                         "threads_inproc", "procs_inproc", "threads1_inproc", "numpy_threads_inproc",
                                                         "numpy_kernels_inproc", "numpy_kernels1_inproc")},
        "ratios": {
            "jobsN_to_numpy": wall["numpy_procs"] / wall["cli_jobsN"],
            "jobs1_to_numpy": wall["numpy_procs"] / wall["cli_jobs1"],
            "jobsN_to_numpy_net": net_ratio(net["cli_jobsN"]),
            "jobs1_to_numpy_net": net_ratio(net["cli_jobs1"]),
            # CPU time (all processes, all threads), net of start-up's: the work each does, whatever
            # else runs on the host (a saturated one cannot show the wall-time gain of a second core)
            "jobsN_to_numpy_cpu_net": cpu_ratio(cpu["cli_jobsN"]),
            "jobs1_to_numpy_cpu_net": cpu_ratio(cpu["cli_jobs1"]),
            "jobsN_speedup": wall["cli_jobs1"] / wall["cli_jobsN"],
            # scan_dump(jobs=N) vs N numpy sums at once, both in this process: no start-up to subtract
            "jobsN_to_numpy_inproc": wall["numpy_threads_inproc"] / wall["threads_inproc"],
            "jobsN_to_numpy_inproc_cpu": cpu["numpy_threads_inproc"] / cpu["threads_inproc"],
            "threads_to_procs_inproc": wall["procs_inproc"] / wall["threads_inproc"],
            "threads_speedup_inproc": wall["threads1_inproc"] / wall["threads_inproc"],
            "numpy_kernels_speedup_inproc": wall["numpy_kernels1_inproc"] / wall["numpy_kernels_inproc"],
        },
        # the command's phases, fastest run of the tree and of the tiny file, and each phase's minimum
        "cli_phases": phases,
        "output_same_for_jobs1_and_N": same, "exit_status": codes.get(n),
        "tensors": len(result.get("tensors") or ()), "errors": len(result.get("errors") or ()),
    }


def report(res: dict[str, Any]) -> str:
    p, w, r, c = res["params"], res["wall_s"], res["ratios"], res["cores_used"]
    goal = GOAL_2CORE if res["host"]["cpus_allowed"] <= 2 else GOAL_MANY
    v = r["jobsN_to_numpy_net"]
    f = lambda x: "n/a (start-up swamps the work)" if x is None else f"{x:.3f}"  # noqa: E731
    return "\n".join([
        f"scantree: {p['ranks']} ranks x {p['files']} files x {p['file_mib']} MiB fp32 .npy "
        f"({p['bytes'] / 1e9:.2f} GB) in the page cache, N = {p['jobs']}, best of {p['repeat']}, interleaved "
        f"(load average {res['loadavg_1min'][0]:.1f} -> {res['loadavg_1min'][1]:.1f}; "
        f"{res['host']['cpus_allowed']} CPUs)",
        f"  scan --jobs {p['jobs']} {w['cli_jobsN']:.2f} s, --jobs 1 {w['cli_jobs1']:.2f} s, {p['jobs']} numpy "
        f"processes {w['numpy_procs']:.2f} s; start-up: scan {w['cli_startup']:.2f} s, numpy {w['numpy_startup']:.2f} s",
        f"  scan --jobs {p['jobs']} / {p['jobs']} numpy processes, net of start-up: {f(v)} "
        f"(goal >= {goal}: {'within goal' if v is not None and v >= goal else 'BELOW GOAL'}); "
        f"gross {r['jobsN_to_numpy']:.3f}; --jobs 1: net {f(r['jobs1_to_numpy_net'])}, gross {r['jobs1_to_numpy']:.3f}",
        f"  by CPU time net of start-up (the work, whatever else runs): --jobs {p['jobs']} "
        f"{f(r['jobsN_to_numpy_cpu_net'])}, --jobs 1 {f(r['jobs1_to_numpy_cpu_net'])}",
        f"  in-process, no start-up: scan_dump(jobs={p['jobs']}) / {p['jobs']} numpy sums at once: "
        f"{r['jobsN_to_numpy_inproc']:.3f} wall ({w['threads_inproc']:.2f} s vs {w['numpy_threads_inproc']:.2f} s), "
        f"{r['jobsN_to_numpy_inproc_cpu']:.3f} by CPU time",
        f"  --jobs {p['jobs']} vs --jobs 1: {r['jobsN_speedup']:.2f}x; cores used (CPU/wall): --jobs {p['jobs']} "
        f"{c['cli_jobsN']:.2f}, --jobs 1 {c['cli_jobs1']:.2f}, numpy {c['numpy_procs']:.2f}",
        f"  in-process, no start-up: {p['jobs']} threads {w['threads_inproc']:.2f} s ({c['threads_inproc']:.2f} cores), "
        f"{p['jobs']} forked processes {w['procs_inproc']:.2f} s, 1 thread {w['threads1_inproc']:.2f} s: "
        f"threads/processes speed {r['threads_to_procs_inproc']:.2f}x",
        f"  numpy kernels (the fallback), in-process: {p['jobs']} threads {w['numpy_kernels_inproc']:.2f} s "
        f"({c['numpy_kernels_inproc']:.2f} cores), 1 thread {w['numpy_kernels1_inproc']:.2f} s: "
        f"{r['numpy_kernels_speedup_inproc']:.2f}x",
        f"  the command's phases (bench/cliphases.py, fastest run; seconds of wall time):",
        report_line(f"tree, --jobs {p['jobs']}", res["cli_phases"]["tree"]),
        report_line("tiny file", res["cli_phases"]["tiny"]),
        "    phase minima, tree - tiny: " + ", ".join(
            f"{k} {res['cli_phases']['tree']['phases_min_s'][k] - res['cli_phases']['tiny']['phases_min_s'][k]:+.3f}"
            for k in PHASES) + f" (scan_dump in-process: {w['threads_inproc']:.3f})",
        f"  output of --jobs 1 and --jobs {p['jobs']} identical: {res['output_same_for_jobs1_and_N']} "
        f"(exit {res['exit_status']}, {res['tensors']} tensors, {res['errors']} unreadable)",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=None, help="rank folders (default 8, quick 2)")
    p.add_argument("--files", type=int, default=None, help="files per rank (default 4, quick 2)")
    p.add_argument("--file-mib", type=int, default=None, help="MiB per file (default 128, quick 2)")
    p.add_argument("--jobs", type=int, default=None, help="N: scan --jobs N and N numpy processes "
                                                          "(default: the CPUs allowed, at most 8)")
    p.add_argument("--repeat", type=int, default=None, help="best of N (default 3, quick 1)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(ranks=args.ranks or (2 if q else 8), files=args.files or (2 if q else 4),
               file_mib=args.file_mib or (2 if q else 128), jobs=args.jobs, repeat=args.repeat or (1 if q else 3))


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], "scantree", argv)


if __name__ == "__main__":
    raise SystemExit(main())
