"""``compare`` against ``msprobe compare`` and against ``cat``: wall time, end to end, on one
generated msprobe dump pair of ~90 MB per side (goals: ours >= 40x faster than msprobe, and <= 3x
the time ``cat`` needs to read both trees from the page cache). All run as commands, as a user
runs them, interleaved round by round, best of N; with them the floors: ``python -c pass`` (the
interpreter), the command's own imports and parser without any work (``ours_imports``), and
``python -c 'import numpy'``, which a float pair the C kernel reads whole no longer pays
(kernels/lazy.py, kernels/compare_raw.py).

The pair is written by this script (no torch needed): an L1 tensor dump (``dump.json`` plus one
``torch.save``-format ``.pt`` file per tensor) of ten MLP blocks (d=384, hidden 1536, 128 tokens),
forward only, 251 tensors; the target computes one block's second linear in float16, so both tools
have real differences to report and ours must name that op.

msprobe (PyPI ``mindstudio-probe``) is installed only with ``--with-msprobe``, only into a
throw-away venv of this script's own (``--venv DIR`` keeps and reuses one), with CPU torch from
``pip install torch==2.13.0`` (a local wheel through ``--find-links /opt/wheels`` where that
exists). Never in CI; without the flag msprobe is not timed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from . import common

GOAL_SPEEDUP = 40.0     # ours >= 40x faster than msprobe compare
GOAL_CAT = 3.0          # ours <= 3x the time cat needs to read both trees
WHEELS = "/opt/wheels"  # a local torch wheel, where the host has one
MSPROBE = "mindstudio-probe==26.2.0"
TORCH = "torch==2.13.0"
D, HIDDEN, TOKENS = 384, 1536, 128
DRIFT_BLOCK = 3


# -- a torch.save file without torch -------------------------------------------------------------
def _pk_str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _pk_int(v: int) -> bytes:
    return b"J" + struct.pack("<i", v)


def _pk_ints(vals: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_pk_int(v) for v in vals) + b"t"


def write_pt(path: Path, arr: np.ndarray) -> None:
    """``torch.save(tensor)`` of a C-contiguous float32 array: the zip layout and the protocol-2
    pickle torch writes (``_rebuild_tensor_v2`` over one persistent FloatStorage)."""
    a = np.ascontiguousarray(arr, dtype=np.float32)
    strides = tuple(s // 4 for s in a.strides) if a.ndim else ()
    pkl = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((" + _pk_str("storage")
           + b"ctorch\nFloatStorage\n" + _pk_str("0") + _pk_str("cpu") + _pk_int(a.size) + b"tQ"
           + _pk_int(0) + _pk_ints(a.shape) + _pk_ints(strides)
           + b"\x89ccollections\nOrderedDict\n)Rt" + b"R.")
    stem = path.name[:-3]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{stem}/data.pkl", pkl)
        z.writestr(f"{stem}/.format_version", "1")
        z.writestr(f"{stem}/.storage_alignment", "64")
        z.writestr(f"{stem}/byteorder", "little")
        _write_aligned(z, f"{stem}/data/0", a.tobytes())
        z.writestr(f"{stem}/version", "3\n")


def _write_aligned(z: zipfile.ZipFile, name: str, data: bytes, align: int = 64) -> None:
    """A stored member whose data starts at a multiple of ``align`` in the file, as torch's
    writer places storages (padding in an "FB" extra field of the local header): a reader can
    map the tensor and read whole words in place."""
    assert z.fp is not None
    start = z.fp.tell() + 30 + len(name.encode()) + 4      # local header, name, extra field id+size
    pad = -start % align
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    z.writestr(info, data)


# -- the dump pair --------------------------------------------------------------------------------
def _item(a: np.ndarray, name: str) -> dict[str, Any]:
    f = a.astype(np.float64)
    return {"type": "torch.Tensor", "dtype": "torch.float32", "shape": list(a.shape),
            "Max": float(f.max()), "Min": float(f.min()), "Mean": float(f.mean()),
            "Norm": float(np.linalg.norm(f)), "requires_grad": False, "data_name": name}


def _forward(blocks: int, half_block: int | None) -> list[tuple[str, dict[str, list[np.ndarray]]]]:
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((TOKENS, D), dtype=np.float32)
    entries: list[tuple[str, dict[str, list[np.ndarray]]]] = []
    for i in range(blocks):
        w1 = (rng.standard_normal((HIDDEN, D), dtype=np.float32) * D ** -0.5).astype(np.float32)
        b1 = np.zeros(HIDDEN, np.float32)
        w2 = (rng.standard_normal((D, HIDDEN), dtype=np.float32) * HIDDEN ** -0.5).astype(np.float32)
        b2 = np.zeros(D, np.float32)
        g, beta = np.ones(D, np.float32), np.zeros(D, np.float32)
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        ln = ((x - mu) / np.sqrt(var + 1e-5) * g + beta).astype(np.float32)
        h = ln @ w1.T + b1
        act = (0.5 * h * (1 + np.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))).astype(np.float32)
        if i == half_block:
            y = (act.astype(np.float16) @ w2.T.astype(np.float16) + b2.astype(np.float16)).astype(np.float32)
        else:
            y = act @ w2.T + b2
        out = x + y
        entries += [(f"Functional.layer_norm.{i}.forward", {"input_args": [x, g, beta], "output": [ln]}),
                    (f"Functional.linear.{2 * i}.forward", {"input_args": [ln, w1, b1], "output": [h]}),
                    (f"Functional.gelu.{i}.forward", {"input_args": [h], "output": [act]}),
                    (f"Functional.linear.{2 * i + 1}.forward", {"input_args": [act, w2, b2], "output": [y]}),
                    (f"Tensor.__add__.{i}.forward", {"input_args": [x, y], "output": [out]})]
        x = out
    return entries


def write_dump(root: Path, blocks: int, half_block: int | None) -> int:
    """``root/step0/rank0/{dump.json, stack.json, construct.json, dump_tensor_data/*.pt}``; bytes."""
    d = root / "step0" / "rank0"
    data_dir = d / "dump_tensor_data"
    data_dir.mkdir(parents=True)
    data: dict[str, Any] = {}
    total = 0
    for key, slots in _forward(blocks, half_block):
        entry: dict[str, Any] = {}
        for slot, arrays in slots.items():
            items = []
            for j, a in enumerate(arrays):
                name = f"{key}.{'input' if slot.startswith('input') else slot}.{j}.pt"
                write_pt(data_dir / name, a)
                total += a.nbytes
                items.append(_item(a, name))
            entry[slot] = items
        entry["input_kwargs"] = {}
        data[key] = entry
    doc = {"task": "tensor", "level": "L1", "framework": "pytorch", "dump_data_dir": str(data_dir),
           "data": data}
    (d / "dump.json").write_text(json.dumps(doc, indent=1))
    (d / "stack.json").write_text("{}")
    (d / "construct.json").write_text("{}")
    return total


# -- timing -----------------------------------------------------------------------------------------
# what `precision-agent compare` imports and builds before it reads a byte (cli.main's path)
_IMPORTS = ("from precision_agent.commands.cli import build_parser; build_parser('compare'); "
            "import precision_agent.commands.tools, precision_agent.compare.engine, precision_agent.compare.pairing, "
            "precision_agent.compare.report, precision_agent.fusion.context")
def _env(**extra: str) -> dict[str, str]:
    """The environment a user's shell gives both tools: bytecode caches written and used, as
    after any pip install (a CI shell may set PYTHONDONTWRITEBYTECODE: ~60 ms more per start)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(extra)
    return env


class Tool:
    """One command timed as a user runs it: wall time per run, and the child's CPU time."""

    def __init__(self, name: str, cmd: list[str], ok: tuple[int, ...], env: dict[str, str] | None = None,
                 keep_stdout: bool = False) -> None:
        self.name, self.cmd, self.ok, self.env, self.keep = name, cmd, ok, env or _env(), keep_stdout
        self.walls: list[float] = []
        self.cpus: list[float] = []
        self.out = ""

    def once(self, record: bool = True) -> None:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        p = subprocess.run(self.cmd, stdout=subprocess.PIPE if self.keep else subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=1800, env=self.env)
        wall = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode not in self.ok:
            raise RuntimeError(f"{self.name}: {' '.join(self.cmd[:4])}... exited {p.returncode}: "
                               f"{p.stderr.decode(errors='replace')[-2000:]}")
        if self.keep:
            self.out = p.stdout.decode()
        if record:
            self.walls.append(wall)
            self.cpus.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))

    def summary(self) -> dict[str, Any]:
        return {"best_s": min(self.walls), "walls_s": self.walls, "best_cpu_s": min(self.cpus), "cpus_s": self.cpus}


def interleaved(tools: list[Tool], repeat: int) -> None:
    """One untimed run of each (bytecode and page caches, as a user's second run), then
    ``repeat`` rounds, each running every tool once: a busy spell of a shared host hits all
    tools alike, and the best of each is compared."""
    for t in tools:
        t.once(record=False)
    for _ in range(repeat):
        for t in tools:
            t.once()


def _msprobe_venv(venv: Path) -> tuple[Path, float]:
    """mindstudio-probe and CPU torch in a venv of their own (never the project's); torch from
    pip's configured find-links (a local wheel) or the index."""
    t = time.perf_counter()
    exe = venv / "bin" / "msprobe"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        links = ["--find-links", WHEELS] if os.path.isdir(WHEELS) else []
        subprocess.run(pip + links + [TORCH], check=True, timeout=1800)
        subprocess.run(pip + links + [MSPROBE], check=True, timeout=1800)
    return exe, time.perf_counter() - t


def run(blocks: int = 10, repeat: int = 5, with_msprobe: bool = False, venv: Path | None = None,
        jobs: int | None = None, agent_python: str | None = None) -> dict[str, Any]:
    """``agent_python``: the interpreter whose installed agent is timed (default: this one, the
    development venv's editable install, whose import finder costs every start ~20 ms that a
    wheel install does not)."""
    py = agent_python or sys.executable
    res: dict[str, Any] = {"bench": "compare_msprobe", "date": common.now_iso(), "host": common.host_info(),
                           "load_average": os.getloadavg(),
                           "params": {"blocks": blocks, "repeat": repeat, "with_msprobe": with_msprobe, "jobs": jobs,
                                      "agent_python": py,
                                      "d": D, "hidden": HIDDEN, "tokens": TOKENS, "drift_block": DRIFT_BLOCK},
                           "goal": {"speedup": GOAL_SPEEDUP, "cat_ratio": GOAL_CAT}}
    with tempfile.TemporaryDirectory(prefix="pa-cmp-") as tmp:
        tmpd = Path(tmp)
        half = DRIFT_BLOCK if blocks > DRIFT_BLOCK else 0
        nbytes = write_dump(tmpd / "bench", blocks, None)
        write_dump(tmpd / "target", blocks, half)
        files = sorted(str(f) for side in ("bench", "target") for f in (tmpd / side).rglob("*") if f.is_file())
        on_disk = sum(os.path.getsize(f) for f in files) // 2
        res["params"].update(tensor_bytes_per_side=nbytes, bytes_per_side=on_disk,
                             files_per_side=len(list((tmpd / "bench").rglob("*.pt"))))
        ours_cmd = [py, "-m", "precision_agent", "compare",
                    str(tmpd / "bench" / "step0"), str(tmpd / "target" / "step0"), "--json"]
        ours = Tool("ours", ours_cmd + (["--jobs", str(jobs)] if jobs else []), ok=(1,), keep_stdout=True)
        tools = [ours, Tool("ours_jobs1", ours_cmd + ["--jobs", "1"], ok=(1,)),
                 Tool("ours_numpy_kernels", ours_cmd + ["--jobs", "1"], ok=(1,), env=_env(PRECISION_AGENT_KERNELS="numpy")),
                 Tool("cat", ["cat", *files], ok=(0,)),    # both trees, from the page cache
                 # the floor under any Python compare: the interpreter's start, and numpy's import
                 Tool("python_start", [py, "-c", "pass"], ok=(0,)),
                 Tool("ours_imports", [py, "-c", _IMPORTS], ok=(0,)),
                 Tool("numpy_import", [py, "-c", "import numpy"], ok=(0,),
                      env=_env(OPENBLAS_NUM_THREADS="1"))]
        outdir = tmpd / "msprobe_out"
        if with_msprobe:
            keep = venv is not None
            vdir = venv or tmpd / "venv"
            exe, setup = _msprobe_venv(vdir)
            tools.append(Tool("msprobe", [str(exe), "compare", "-tp", str(tmpd / "target" / "step0"), "-gp",
                                          str(tmpd / "bench" / "step0"), "-o", str(outdir)], ok=(0,)))
        interleaved(tools, repeat)
        for t in tools[1:]:
            res[t.name] = t.summary()
        doc = json.loads(ours.out)
        o = ours.summary()
        res["ours"] = {**o, "pairs": doc["pairs"], "first_diverging_op": (doc["first_diverging_op"] or {}).get("op"),
                       "mb_per_s": 2 * on_disk / common.MB / o["best_s"]}
        res["ours"]["names_drift_op"] = res["ours"]["first_diverging_op"] == f"Functional.linear.{2 * half + 1}.forward"
        res["ratios"] = {"cat": o["best_s"] / res["cat"]["best_s"]}
        res["ratios"]["cat_to_goal"] = res["ratios"]["cat"] / GOAL_CAT
        if with_msprobe:
            ms = res["msprobe"]
            csvs = sorted(outdir.glob("compare_result_*.csv"))
            rows, errors = _msprobe_rows(csvs[-1]) if csvs else (0, 0)
            ms.update(venv_setup_s=setup, rows=rows, error_rows=errors,
                      mb_per_s=2 * on_disk / common.MB / ms["best_s"], venv_kept=str(vdir) if keep else None)
            speedup = ms["best_s"] / o["best_s"]
            res["ratios"].update(speedup=speedup, speedup_to_goal=speedup / GOAL_SPEEDUP,
                                 cpu_speedup=ms["best_cpu_s"] / o["best_cpu_s"])
            if not keep:
                shutil.rmtree(vdir, ignore_errors=True)
    res["load_average_after"] = os.getloadavg()
    return res


def _msprobe_rows(path: Path) -> tuple[int, int]:
    import csv
    with path.open(newline="", encoding="utf-8", errors="replace") as fh:
        rows = list(csv.DictReader(fh))
    return len(rows), sum(r.get("Result", "").strip().lower() == "error" for r in rows)


def report(res: dict[str, Any]) -> str:
    p, o, r = res["params"], res["ours"], res["ratios"]
    la = ", ".join(f"{x:.1f}" for x in res["load_average"])
    lines = [f"compare_msprobe: {p['bytes_per_side'] / common.MB:.1f} MB per side, {p['files_per_side']} .pt files, "
             f"interleaved best of {p['repeat']}, {res['host']['cpus_allowed']} CPUs, load average {la}",
             f"  agent and floors run by {p.get('agent_python') or sys.executable}",
             f"  ours (precision-agent compare --json{' --jobs ' + str(p['jobs']) if p['jobs'] else ''}): "
             f"{o['best_s']:.3f} s wall, {o['best_cpu_s']:.3f} s CPU ({o['mb_per_s']:.0f} MB/s), "
             f"{o['pairs']} pairs, first diverging op {o['first_diverging_op']} "
             f"({'the planted one' if o['names_drift_op'] else 'NOT the planted one'})"]
    for key, label in (("ours_jobs1", "ours --jobs 1"), ("ours_numpy_kernels", "ours --jobs 1, PRECISION_AGENT_KERNELS=numpy"),
                       ("cat", "cat of both trees (page cache)"), ("python_start", "python -c pass (the interpreter's start)"),
                       ("ours_imports", "our start: interpreter, compare's imports and parser, no work"),
                       ("numpy_import", "python -c 'import numpy'")):
        t = res[key]
        lines.append(f"  {label}: {t['best_s']:.3f} s wall, {t['best_cpu_s']:.3f} s CPU")
    lines.append(f"  ours / cat: {r['cat']:.1f}x (goal <= {GOAL_CAT:.0f}x: "
                 f"{'within goal' if r['cat'] <= GOAL_CAT else 'OVER GOAL'}); numpy's import alone: "
                 f"{res['numpy_import']['best_s'] / res['cat']['best_s']:.1f}x cat")
    m = res.get("msprobe")
    if m is None:
        lines.append("  msprobe compare: not run (--with-msprobe installs it into a throw-away venv)")
    else:
        s = r["speedup"]
        lines += [f"  msprobe compare (CLI): {m['best_s']:.2f} s wall, {m['best_cpu_s']:.2f} s CPU "
                  f"({m['mb_per_s']:.0f} MB/s), {m['rows']} rows, "
                  f"{m['error_rows']} 'error' (venv setup {m['venv_setup_s']:.0f} s, not counted)",
                  f"  speedup {s:.1f}x wall (goal >= {GOAL_SPEEDUP:.0f}x: "
                  f"{'within goal' if s >= GOAL_SPEEDUP else 'BELOW GOAL'}), {r['cpu_speedup']:.1f}x CPU"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=None, help="MLP blocks (default 10: ~92 MB per side; quick 2)")
    p.add_argument("--repeat", type=int, default=None, help="rounds, best of N (default 5, quick 1)")
    p.add_argument("--jobs", type=int, default=None, help="our --jobs (default: the CLI's, the usable CPUs)")
    p.add_argument("--with-msprobe", action="store_true",
                   help=f"also time msprobe compare ({MSPROBE}, {TORCH} into a throw-away venv)")
    p.add_argument("--venv", type=Path, default=None, help="keep and reuse msprobe's venv here")
    p.add_argument("--agent-python", default=None, metavar="PYTHON",
                   help="time the agent installed for this interpreter (e.g. a venv with a wheel install); "
                        "default: this one")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(blocks=args.blocks or (2 if q else 10), repeat=args.repeat or (1 if q else 5),
               with_msprobe=args.with_msprobe, venv=args.venv, jobs=args.jobs, agent_python=args.agent_python)


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], "compare_msprobe", argv)


if __name__ == "__main__":
    raise SystemExit(main())
