"""`replay --json` on the committed output of real trainers (tests/fixtures/trainers, made by its
make.py with the real libraries): every faulty run pages at the step its NaN was planted at (the
first logged step that shows it, ``expect_page`` in its run.json), no healthy run pages. The rows
are judged as the trainers canary judges them (bench/trainers.py, ``judge``)."""

from __future__ import annotations

import fnmatch
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from precision_agent.config.agent import Watch
from support.commands import replay_json

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is a top-level package of the repo, not installed
    sys.path.insert(0, str(ROOT))

from bench.trainer_runs import Run  # noqa: E402
from bench.trainers import judge, sources  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "trainers"
RUNS = sorted(p.parent for p in FIXTURES.glob("*/*/run.json"))
CASES = [(run, src) for run in RUNS for src in sources(run)]


def read_by_default(name: str) -> bool:
    """Whether a log watch follows such a file by default (the metric-file readers add event
    files and metrics.csv to the default include patterns)."""
    return any(fnmatch.fnmatch(name, pat) for pat in Watch(path="/x").patterns)


def test_every_trainer_and_variant_is_there():
    names = {(r.parent.name.split("-")[0], r.name) for r in RUNS}
    for trainer in ("transformers", "lightning"):
        assert {(trainer, "healthy"), (trainer, "nan")} <= names
    cpu = {r.parent.name for r in RUNS if r.parent.name.startswith("transformers-") and "cuda" not in r.parent.name}
    assert len(cpu) == 2  # 5.x and 4.x on CPU
    # one real GPU run (an H200, fp16 mixed precision with GradScaler): a real fp16 overflow, not a planted NaN
    assert any(r.parent.name.endswith("-cuda-fp16") and r.name == "overflow" for r in RUNS)


@pytest.fixture(scope="module")
def replays() -> dict[Path, Any]:
    """``replay --json`` of every source read by default, one process per source, as many at once
    as there are cores (each is a separate command run, as before; only the waiting is shared)."""
    srcs = [src for _run, src in CASES if src.name == "train.log" or read_by_default(src.name)]
    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        futures = {src: pool.submit(replay_json, src) for src in srcs}
    return futures


@pytest.mark.parametrize("run_dir,src", CASES, ids=[f"{r.parent.name}/{r.name}/{s.name[:22]}" for r, s in CASES])
def test_fixture_source_pages_at_the_planted_step(run_dir, src, replays):
    if src.name != "train.log" and not read_by_default(src.name):
        pytest.skip(f"{src.name}: no metric-file reader in this build")
    data = json.loads((run_dir / "run.json").read_text())
    # HF's NaN filter logs the NaN loss as 0 beside a NaN grad norm: these CPU runs state no precision
    # (loss scaling "unknown"), where that pair pages on its second report in a row (a converged
    # loss rounded to 0.0 beside one scaler overflow must not), naming the first: the planted step
    run = Run(**data)
    row = judge(run, src, replays[src].result(), daemon=False)  # its exit status checked there too
    assert row["records"] > 0, row
    assert row["ok"], row
