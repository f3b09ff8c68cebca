"""The daemon's per-directory duties: pair a finished dump step with the other run's, compare,
write the table, digest; wait while the other side is incomplete."""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path

import numpy as np
import pytest

from precision_agent.compare.live import DumpWork, after_scan, compare_sample, counterpart
from precision_agent.config import CompareSpec

from conftest import corpus_path


def _tree(root: Path, weights: dict[str, np.ndarray]) -> Path:
    for rel, a in weights.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        np.save(p, a)
    old = time.time() - 60
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            os.utime(os.path.join(dirpath, f), (old, old))
    return root


def _work(tmp: Path, target: Path, bench: Path, mode: str = "benchmark", digest: str | None = None) -> DumpWork:
    return DumpWork(target, CompareSpec(against=bench, mode=mode), digest, tmp / "csv")


def test_counterpart_is_the_same_relative_directory(tmp_path: Path) -> None:
    w = _work(tmp_path, tmp_path / "run", tmp_path / "bench")
    assert counterpart(str(tmp_path / "run" / "step3" / "rank0"), w) == tmp_path / "bench" / "step3" / "rank0"
    assert counterpart(str(tmp_path / "run"), w) == tmp_path / "bench"
    assert counterpart(str(tmp_path / "elsewhere"), w) is None


def test_rerun_difference_names_the_first_differing_tensor_and_writes_a_table(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a = {f"step1/{i:02d}_op{i}.npy": rng.standard_normal(64).astype(np.float32) for i in range(4)}
    b = {k: v.copy() for k, v in a.items()}
    b["step1/02_op2.npy"][7] = np.nextafter(b["step1/02_op2.npy"][7], np.float32(9))  # one ulp
    run, rerun = _tree(tmp_path / "run", a), _tree(tmp_path / "rerun", b)
    work = _work(tmp_path, run, rerun, mode="rerun")
    out = after_scan(str(run / "step1"), work, settle=1.0)
    res = out.compare
    assert res["mode"] == "rerun" and not res["identical"] and res["differ_bitwise"] == 1
    assert res["first_differing_tensor"]["op"].startswith("02_op2")
    assert res["first_differing_tensor"]["step"] == 1
    s = compare_sample(res, {"run": "r1"}, str(run / "step1"))
    assert s is not None and s.metric == "dump_nondeterminism" and s.attr("op").startswith("02_op2")
    with open(res["csv"], newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0][0] == "Index" and len(rows) == 5


def test_identical_steps_give_a_clean_sample_and_an_incomplete_side_waits(tmp_path: Path) -> None:
    a = {"step0/w.npy": np.arange(10, dtype=np.float32)}
    run, other = _tree(tmp_path / "run", a), _tree(tmp_path / "other", a)
    work = _work(tmp_path, run, other, mode="rerun")
    res = after_scan(str(run / "step0"), work, settle=1.0).compare
    clean = compare_sample(res, {}, str(run / "step0"))   # value 0: a clean step for the incident kinds
    assert res["identical"] and clean.value == 0.0 and clean.step == 0
    # when the unit was written (its newest file), for the incident kinds' restart test
    assert abs(clean.attr("written") - os.stat(run / "step0" / "w.npy").st_mtime) < 1e-3
    (run / "step1").mkdir()
    np.save(run / "step1" / "w.npy", a["step0/w.npy"])
    assert after_scan(str(run / "step1"), work, settle=1.0).waiting_for == str(other / "step1")
    (other / "step1").mkdir()
    np.save(other / "step1" / "w.npy", a["step0/w.npy"])
    assert after_scan(str(run / "step1"), work, settle=30.0).waiting_for is not None  # just written: not settled


@pytest.mark.corpus
def test_drift_against_bench_names_the_fp16_linear(tmp_path: Path) -> None:
    root = corpus_path("msprobe")
    work = _work(tmp_path, root / "drift", root / "bench", digest=r"^Functional\.linear\.\d+\.forward input\[1\]$")
    out = after_scan(str(root / "drift" / "step0" / "rank0"), work, settle=0.0)
    res = out.compare
    assert res["first_diverging_op"]["op"] == "Functional.linear.5.forward"
    s = compare_sample(res, {"run": "drift"}, str(root / "drift"))
    assert s is not None and s.metric == "dump_divergence" and dict(s.labels) == {"run": "drift", "rank": "0"}
    assert s.attr("op") == "Functional.linear.5.forward" and s.step == 0
    assert s.attr("rank") == 0 and s.attr("written") is not None   # each rank its own progress (issue 20)
    assert Path(res["csv"]).name == "step0__rank0.csv"
    (d,) = out.digests
    assert d.step == 0 and d.rank == 0 and d.tensors == 9


def test_step_from_the_directory_name(tmp_path: Path) -> None:
    from precision_agent.compare.live import path_step
    assert path_step(str(tmp_path / "step12" / "rank0"), tmp_path) == 12
    assert path_step(str(tmp_path / "iter_7"), tmp_path) == 7
    assert path_step(str(tmp_path / "rank0"), tmp_path) is None
    assert path_step(str(tmp_path), tmp_path) is None


def test_an_unwritable_table_directory_is_reported_not_fatal(tmp_path: Path) -> None:
    a = {"step0/w.npy": np.arange(10, dtype=np.float32)}
    run, other = _tree(tmp_path / "run", a), _tree(tmp_path / "other", a)
    (tmp_path / "blocked").write_text("a file where the table directory should be")
    work = DumpWork(run, CompareSpec(against=other, mode="rerun"), None, tmp_path / "blocked" / "csv")
    res = after_scan(str(run / "step0"), work, settle=1.0).compare
    assert res["identical"] and res["csv"] is None and "cannot write the comparison table" in res["csv_error"]
