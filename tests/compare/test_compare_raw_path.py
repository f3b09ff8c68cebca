"""compare's path without numpy (DumpTensor.raw -> metrics.compare_raw, the verdict's statistics
through scanner.scan_words): the same rows, bits, JSON, text and CSV as the arrays' path on the
real msprobe fixtures and on generated pairs with NaN, strided, misaligned and half tensors; and
the command itself does not import numpy for a pair the C kernel reads whole."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from precision_agent import kernels
from precision_agent.compare.engine import compare_sides
from precision_agent.compare.pairing import read_side
from precision_agent.compare.report import format_text, to_json, write_csv
from precision_agent.dumps.msprobe import read_msprobe_rank_dir
from precision_agent.model import json_safe
from conftest import corpus_path
from support.torchpt import write_msprobe_pt

TENSORS = Path(__file__).resolve().parents[1] / "fixtures" / "msprobe_incidents" / "healthy" / "adamw_1e-4_tensor"
# real msprobe L1 tensor dumps (torch.save files): in the repository, and the shared corpus's sets
PAIRS = [(TENSORS / "step0", TENSORS / "step1"), (TENSORS / "step0", TENSORS / "step0"),
         ("corpus", "bench", "drift"), ("corpus", "bench", "nan"), ("corpus", "bench", "same")]


@pytest.fixture(autouse=True)
def c_kernel():
    if not kernels.built("compare") or not kernels.built("scan"):
        assert os.environ.get("CI") != "true", "the C kernels must be built in CI"
        pytest.skip("C kernels not built")
    with kernels.forced("c"):
        yield


def _outputs(bench: Path, target: Path, raw: bool, **kw) -> tuple:
    t, b = read_side(target), read_side(bench)
    if not raw:
        for side in (t, b):
            for x in side.tensors:
                x.raw = None
    res = compare_sides(t, b, **kw)
    csv = io.StringIO()
    write_csv(res, csv, "msprobe")
    rows = [(r.index, r.ok, r.equal, r.fail_reason, None if r.diff is None else json.dumps(json_safe(r.diff.metrics)))
            for r in res.rows]
    return rows, json.dumps(json_safe(to_json(res))), format_text(res), csv.getvalue()


def _raw_share(root: Path) -> float:
    ts = [t for d in sorted(root.rglob("dump.json")) for t in read_msprobe_rank_dir(d.parent) if t.raw is not None]
    return sum(t.raw() is not None for t in ts) / max(1, len(ts))


@pytest.mark.parametrize("pair", PAIRS, ids=["step0-step1", "step0-step0", "corpus-drift", "corpus-nan", "corpus-same"])
def test_real_msprobe_pairs_give_the_same_report_without_numpy(pair):
    if pair[0] == "corpus":
        bench, target = corpus_path("msprobe", pair[1]), corpus_path("msprobe", pair[2])
    else:
        bench, target = pair
    assert _raw_share(target) > 0.9, "msprobe's .pt files (torch.save) take the raw path"
    arrays = _outputs(bench, target, raw=False)
    assert arrays[0]
    assert _outputs(bench, target, raw=True) == arrays
    assert _outputs(bench, target, raw=True, jobs=3) == arrays


def _mixed_pair(tmp: Path, align: int) -> tuple[Path, Path]:
    """Ops of float32 and float16, one strided (a transposed weight), one with NaN on the target
    side, one lost to half precision; storages at multiples of ``align`` (0: anywhere)."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((64, 96)).astype(np.float32)
    h = rng.standard_normal(5_000).astype(np.float16)
    big = rng.standard_normal(300_000).astype(np.float32)
    for side in ("bench", "target"):
        nan = big.copy()
        if side == "target":
            nan[12_345] = np.nan
        lost = big.astype(np.float16).astype(np.float32) if side == "target" else big
        entries = {"Functional.linear.0.forward": {"input_args": [a, a.T], "output": [a @ a.T]},
                   "Functional.gelu.1.forward": {"input_args": [h], "output": [h * np.float16(0.5)]},
                   "Functional.add.2.forward": {"input_args": [big], "output": [lost]},
                   "Functional.mul.3.forward": {"input_args": [big], "output": [nan]}}
        write_msprobe_pt(tmp / side / "step0" / "rank0", entries, align=align)
    return tmp / "bench", tmp / "target"


@pytest.mark.parametrize("align", [64, 0])
@pytest.mark.parametrize("preset, rerun", [("strict", False), ("msaccucmp", False), ("strict", True)])
def test_generated_pairs_give_the_same_report_either_way(tmp_path, align, preset, rerun):
    bench, target = _mixed_pair(tmp_path, align)
    arrays = _outputs(bench, target, raw=False, preset=preset, rerun=rerun)
    assert _outputs(bench, target, raw=True, preset=preset, rerun=rerun) == arrays
    if preset == "strict":   # the first op whose output lost precision (or bits, in a rerun)
        assert json.loads(arrays[1])["first_diverging_op"]["op"] == "Functional.add.2.forward"


_PROBE = textwrap.dedent("""
    import argparse, sys
    from precision_agent.commands import compare
    p = argparse.ArgumentParser()
    compare.add_parser(p.add_subparsers(dest="command"))
    rc = compare.run(p.parse_args(["compare", sys.argv[1], sys.argv[2], "--json", "--jobs", "2"]))
    sys.stdout.flush()
    print("numpy imported:", "numpy" in sys.modules, file=sys.stderr)
    sys.exit(rc)
""")


def _command(bench: Path, target: Path) -> tuple[dict, bool]:
    p = subprocess.run([sys.executable, "-c", _PROBE, str(bench), str(target)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PRECISION_AGENT_KERNELS": "c"})
    assert p.returncode == 1, p.stderr
    return json.loads(p.stdout), "numpy imported: True" in p.stderr


def test_the_command_compares_float_dumps_without_importing_numpy(tmp_path):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 128)).astype(np.float32)
    for side in ("bench", "target"):
        out = (w.astype(np.float16).astype(np.float32) if side == "target" else w)
        write_msprobe_pt(tmp_path / side / "step0" / "rank0",
                         {"Functional.linear.0.forward": {"input_args": [w], "output": [w * 2]},
                          "Functional.linear.1.forward": {"input_args": [w * 2], "output": [out]}}, align=64)
    doc, imported = _command(tmp_path / "bench", tmp_path / "target")
    assert doc["first_diverging_op"]["op"] == "Functional.linear.1.forward"
    assert doc["first_diverging_op"]["target_stats"]["max"] is not None   # the verdict's statistics, scanned
    assert not imported, "a float pair the C kernel reads whole needs no numpy"
    # a NaN on one side is numpy's policy: the same command imports it and still names the op
    bench, target = _mixed_pair(tmp_path / "mixed", 64)
    doc, imported = _command(bench, target)
    assert doc["first_diverging_op"]["op"] == "Functional.add.2.forward" and imported
