"""``compare --jobs N``: pairs compared on N threads give the same rows, in the same order, with
the same bits in every metric, and the same JSON, text and CSV, as one thread does; and a
compare leaves the files it read in the page cache (its next run reads none from disk)."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from precision_agent.compare.engine import compare_sides
from precision_agent.compare.pairing import read_side
from precision_agent.compare.report import format_text, to_json, write_csv
from precision_agent.model import json_safe
from support.torchpt import write_msprobe_pt

FIX = Path(__file__).resolve().parents[1] / "fixtures"
PAIRS = [("msprobe_fusion/on_clean", "msprobe_fusion/on_fault"),
         ("msprobe_fusion/on_clean", "msprobe_fusion/on_rerun"),
         ("msprobe_fusion/off", "msprobe_fusion/on_fault"),          # across fusion (module level)
         ("msprobe_fusion/on_clean", "msprobe_fusion/on_nan"),
         ("msprobe_incidents/two_runs/job_a", "msprobe_incidents/two_runs/job_b"),
         ("msprobe_incidents/restart/attempt1", "msprobe_incidents/restart/attempt2")]


def _bits(v: object) -> object:
    """A value with every float as its bit pattern (NaN == NaN, -0.0 != 0.0)."""
    if isinstance(v, float):
        return struct.pack("<d", v)
    if isinstance(v, dict):
        return {k: _bits(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_bits(x) for x in v]
    return v


def _row_bits(row) -> tuple:
    d, s = row.diff, row.stats_diff
    return (row.index, row.target.path, row.bench.path, row.ok, row.equal, row.fail_reason, _bits(row.tolerance),
            None if d is None else (_bits(d.metrics), d.bitwise_equal, d.count, d.differ, d.first_diff_index,
                                    d.max_abs_index, d.nonfinite_mismatch, d.fail_reason,
                                    _bits(d.target_stats), _bits(d.bench_stats)),
            None if s is None else (_bits(s.diffs), s.equal, s.fail_reason))


def _outputs(bench: Path, target: Path, jobs: int, **kw) -> tuple:
    res = compare_sides(read_side(target), read_side(bench), jobs=jobs, **kw)
    csv = io.StringIO()
    write_csv(res, csv, "msprobe")
    return ([_row_bits(r) for r in res.rows], json.dumps(json_safe(to_json(res))), format_text(res), csv.getvalue())


def _pair(tmp: Path, n: int = 40) -> tuple[Path, Path]:
    """A bench/target pair with more pairs than threads, of several sizes, one differing op."""
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(int(s), dtype=np.float32) for s in rng.integers(1, 300_000, n)]
    for side in ("bench", "target"):
        entries = {}
        for i, a in enumerate(arrays):
            out = a.astype(np.float16).astype(np.float32) if side == "target" and i == n // 2 else a
            entries[f"Functional.op{i}.{i}.forward"] = {"input_args": [a], "output": [out]}
        write_msprobe_pt(tmp / side / "step0" / "rank0", entries)
    return tmp / "bench", tmp / "target"


@pytest.mark.parametrize("bench, target", PAIRS)
def test_fixture_pairs_are_bit_identical_across_job_counts(bench, target):
    one = _outputs(FIX / bench, FIX / target, 1)
    assert one[0], "the pair compares something"
    for jobs in (2, 4):
        assert _outputs(FIX / bench, FIX / target, jobs) == one


@pytest.mark.parametrize("preset, rerun", [("strict", False), ("msaccucmp", False), ("strict", True)])
def test_a_pair_of_many_tensors_is_bit_identical_across_job_counts(tmp_path, preset, rerun):
    bench, target = _pair(tmp_path)
    one = _outputs(bench, target, 1, preset=preset, rerun=rerun)
    assert len(one[0]) == 80 and sum(not r[4] for r in one[0]) == 1   # the planted op differs
    for jobs in (2, 3, 4, 16):
        assert _outputs(bench, target, jobs, preset=preset, rerun=rerun) == one


def test_the_cli_prints_the_same_for_any_jobs_and_refuses_a_bad_count(tmp_path):
    bench, target = _pair(tmp_path, 12)
    outs = set()
    for jobs in ("1", "2", "4"):
        p = subprocess.run([sys.executable, "-m", "precision_agent", "compare", str(bench), str(target), "--json",
                            "--jobs", jobs, "--csv", str(tmp_path / f"t{jobs}.csv")],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 1, p.stderr
        outs.add((p.stdout, (tmp_path / f"t{jobs}.csv").read_text()))
    assert len(outs) == 1
    doc = json.loads(outs.pop()[0])
    assert doc["first_diverging_op"]["op"] == "Functional.op6.6.forward" and doc["pairs"] == 24
    p = subprocess.run([sys.executable, "-m", "precision_agent", "compare", str(bench), str(target), "--jobs", "0"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--jobs" in p.stderr


def _resident_fraction(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap
    size = path.stat().st_size
    with path.open("rb") as fh:
        mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        base = ctypes.c_void_p(np.frombuffer(mm, np.uint8, count=1).ctypes.data)
        if libc.mincore(base, ctypes.c_size_t(size), vec) != 0:
            pytest.skip(f"mincore: {os.strerror(ctypes.get_errno())}")
        return sum(v & 1 for v in vec) / pages
    finally:
        mm.close()


def test_the_verdicts_extra_pass_keeps_the_compared_files_in_the_page_cache(tmp_path):
    """The statistics shown for the first diverging op are one more pass over its tensors; it
    used to drop their pages from the page cache, so every later compare of the same trees read
    them from disk again."""
    bench, target = _pair(tmp_path, 12)
    files = sorted(bench.rglob("*.pt")) + sorted(target.rglob("*.pt"))
    for f in files:                          # written back (a dirty page cannot be dropped) and cached
        with f.open("rb+") as fh:
            os.fsync(fh.fileno())
        f.read_bytes()
    p = subprocess.run([sys.executable, "-m", "precision_agent", "compare", str(bench), str(target), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    op = json.loads(p.stdout)["first_diverging_op"]["op"]
    verdict = [f for f in files if f.name.startswith(op)]
    assert verdict
    for f in verdict:
        assert _resident_fraction(f) == 1.0, f
