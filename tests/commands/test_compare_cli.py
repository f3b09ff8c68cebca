"""`precision-agent compare` as a command: exit codes, JSON, CSV, filters, progress, bad usage."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np

from precision_agent.compare.report import MSACCUCMP_HEADER, MSPROBE_TENSOR_HEADER
from support.dumps import tiny_net as _net


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precision_agent.commands.compare", "compare", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_exit_codes_and_json(tmp_path):
    _net(tmp_path / "bench")
    _net(tmp_path / "same")
    _net(tmp_path / "drift", half_fc2=True)
    ok = run(tmp_path / "bench", tmp_path / "same", "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["identical"] is True and doc["first_diverging_op"] is None and doc["pairs"] == 12
    bad = run(tmp_path / "bench", tmp_path / "drift", "--json")
    assert bad.returncode == 1, bad.stderr
    doc = json.loads(bad.stdout)
    assert doc["first_diverging_op"]["op"] == "Functional.linear.1.forward"
    assert doc["first_differing_tensor"]["tensor"] == "output[0]" and doc["verdict"] == "lost_precision"
    assert run(tmp_path / "bench", tmp_path / "drift", "--preset", "msaccucmp").returncode == 0


def test_text_report_names_the_op(tmp_path):
    _net(tmp_path / "bench")
    _net(tmp_path / "drift", half_fc2=True)
    p = run(tmp_path / "bench", tmp_path / "drift")
    assert p.returncode == 1
    assert "lost_precision: Functional.linear.1.forward lost precision" in p.stdout
    assert "first differing tensor: Functional.linear.1.forward output[0]" in p.stdout
    assert "compare" not in p.stderr and "scanning" not in p.stderr       # no bar: stderr is no tty
    forced = run(tmp_path / "bench", tmp_path / "drift", "--progress")
    assert "12/12" in forced.stderr


def test_csv_layouts(tmp_path):
    _net(tmp_path / "bench")
    _net(tmp_path / "drift", half_fc2=True)
    out = tmp_path / "out.csv"
    assert run(tmp_path / "bench", tmp_path / "drift", "--csv", out).returncode == 1
    rows = list(csv.reader(out.open()))
    assert rows[0] == MSACCUCMP_HEADER and len(rows) == 13
    assert run(tmp_path / "bench", tmp_path / "drift", "--csv", out, "--csv-layout", "msprobe").returncode == 1
    rows = list(csv.reader(out.open()))
    assert rows[0] == MSPROBE_TENSOR_HEADER
    by_name = {r[0]: r for r in rows[1:]}
    assert by_name["Functional.linear.1.forward.output.0"][-2] == "error"
    assert by_name["Functional.linear.1.forward.input.1"][-2] == "pass"


def test_step_rank_filters_and_rerun(tmp_path):
    _net(tmp_path / "a", step=0)
    _net(tmp_path / "a", step=1)
    _net(tmp_path / "b", step=0)
    _net(tmp_path / "b", step=1, bump=3)
    assert run(tmp_path / "a", tmp_path / "b", "--rerun").returncode == 1
    assert run(tmp_path / "a", tmp_path / "b", "--rerun", "--step", "0").returncode == 0
    doc = json.loads(run(tmp_path / "a", tmp_path / "b", "--rerun", "--json", "--rank", "0").stdout)
    assert doc["verdict"] == "nondeterministic" and doc["first_diverging_op"]["step"] == 1
    assert doc["first_diverging_op"]["op"] == "Torch.tanh.0.forward"


def test_usage_and_read_errors_exit_2(tmp_path):
    _net(tmp_path / "bench")
    missing = run(tmp_path / "bench", tmp_path / "nope")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = run(tmp_path / "bench", tmp_path / "empty")
    assert empty.returncode == 2 and "no tensors" in empty.stderr
    assert run(tmp_path / "bench", tmp_path / "bench", "--preset", "lenient").returncode == 2
    (tmp_path / "other").mkdir()
    np.save(tmp_path / "other" / "x.npy", np.ones(3, np.float32))
    nothing = run(tmp_path / "bench", tmp_path / "other")
    assert nothing.returncode == 2 and "nothing was paired" in nothing.stderr
    unwritable = run(tmp_path / "bench", tmp_path / "bench", "--csv", tmp_path / "no" / "dir" / "x.csv")
    assert unwritable.returncode == 2 and "cannot write" in unwritable.stderr
    # an unreadable tensor among readable ones, nothing diverged: listed, exit 2
    d = _net(tmp_path / "broken")
    (d / "dump_tensor_data" / "Torch.relu.0.forward.output.0.npy").write_bytes(b"junk")
    broken = run(tmp_path / "bench", tmp_path / "broken")
    assert broken.returncode == 2 and "error (pair)" in broken.stdout
