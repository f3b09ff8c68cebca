"""`precision-agent scan`: statistics per tensor and the first bad op, on the msprobe corpus
(GROUND_TRUTH.md), on generated CANN dumps and .npy trees, and with unreadable files among them."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from support import dumps as W
from conftest import corpus_path, wait_for
from precision_agent.commands.scan import scan

MSPROBE_FIRST = {  # set -> first non-finite (op, tensor, step) per corpus/msprobe/GROUND_TRUTH.md
    "bench": None, "same": None, "drift": None, "stats_bench": None, "stats_drift": None,
    "nan": ("Functional.mse_loss.0.forward", "output[0]", 1),
    "stats_nan": ("Functional.mse_loss.0.forward", "output[0]", 1),
}


def cli_scan(path, *extra):
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "scan", "--json", str(path), *extra],
                          capture_output=True, text=True, timeout=300)
    r = json.loads(proc.stdout)
    paging = any(f["severity"] in ("page", "critical") for f in r["findings"])
    assert proc.returncode == (1 if paging else 2 if r["errors"] else 0), proc.stderr  # README's exit codes
    return r


@pytest.mark.corpus
@pytest.mark.parametrize("name", sorted(MSPROBE_FIRST))
def test_msprobe_corpus_first_nonfinite(name):
    r = cli_scan(corpus_path("msprobe", name))
    assert r["layout"] == "msprobe" and r["errors"] == [] and len(r["tensors"]) > 300
    expected = MSPROBE_FIRST[name]
    if expected is None:
        assert r["first_nonfinite"] is None and not any(t["nan"] or t["pos_inf"] or t["neg_inf"]
                                                        for t in r["tensors"])
    else:
        f = r["first_nonfinite"]
        assert (f["op"], f["tensor"], f["step"], f["rank"]) == (*expected, 0)
        assert r["findings"][0]["rule"] == "DumpNonFinite"


@pytest.mark.corpus
def test_step_filter():
    assert cli_scan(corpus_path("msprobe", "nan"), "--step", "0")["first_nonfinite"] is None


def test_cann_dumps_first_bad_op_and_fp16_saturation(tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    good = np.ones((2, 3), np.float32)
    bad = good.copy()
    bad[1, 2] = np.inf
    sat = np.array([1.0, 65504.0, -65504.0], np.float16)
    ops = [("MatMul", "layer0_matmul", [good, good], [good]),
           ("Add", "layer1_add", [good], [bad]),          # finite in, Inf out: the first bad op
           ("Mul", "layer2_mul", [bad], [bad]),            # Inf in: propagation, not the origin
           ("Cast", "layer3_cast", [good], [sat])]
    for i, (op_type, name, ins, outs) in enumerate(ops):
        W.write_cann_dump(str(d / W.dump_name(op_type, name, i + 1, 0, 1_700_000_000_000 + i)),
                          inputs=[W.tensor(a) for a in ins], outputs=[W.tensor(a) for a in outs])
    (d / W.dump_name("Relu", "broken", 9, 0, 1_700_000_000_009)).write_bytes(b"\x10\x00\x00\x00garbage")
    r = scan(d)
    assert r["layout"] == "cann"
    assert r["first_nonfinite"]["op"] == "layer1_add" and r["first_nonfinite"]["tensor"] == "output[0]"
    assert [e["path"].endswith("1700000000009") for e in r["errors"]] == [True]  # reported, scan went on
    sat_stats = [t for t in r["tensors"] if t["name"] == "layer3_cast" and t["io"] == "output"]
    assert sat_stats[0]["fp16_saturated"] == 2
    assert {f["rule"] for f in r["findings"]} == {"DumpNonFinite", "DumpFp16Saturation"}


def test_npy_tree_and_corrupt_file(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(10, dtype=np.float32))
    x = np.zeros(4, np.float64)
    x[2] = np.nan
    np.save(tmp_path / "b.npy", x)
    (tmp_path / "c.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")
    r = cli_scan(tmp_path)
    assert r["layout"] == "npy" and len(r["tensors"]) == 2 and len(r["errors"]) == 1
    (a, b) = r["tensors"]
    assert a["count"] == 10 and a["max"] == 9.0 and a["zero_fraction"] == 0.1 and a["abs_mean"] == 4.5
    assert b["nan"] == 1 and r["first_nonfinite"]["op"] == "b.npy" and b["abs_mean"] == 0.0
    text = subprocess.run([sys.executable, "-m", "precision_agent", "scan", str(tmp_path)], capture_output=True,
                          text=True, timeout=60).stdout
    assert "first bad op: b.npy" in text and "unreadable:" in text


def test_scheduler_waits_for_quiet_and_never_rescans_unchanged(tmp_path):
    from precision_agent.dumps.schedule import DumpScheduler, unit_of
    step = tmp_path / "step1"
    step.mkdir()
    np.save(step / "a.npy", np.ones(3, np.float32))
    os.utime(step / "a.npy", (time.time() - 3600, time.time() - 3600))  # written an hour ago
    sched = DumpScheduler(settle=5.0, queue_size=1, scanned={})
    sched.touched(str(step / "a.npy"), now=100.0)
    sched.due(now=102.0)
    assert sched.queue.empty()                          # not quiet for 5 s yet
    sched.due(now=106.0)
    assert sched.queue.qsize() == 1 and not sched.pending
    sched.start()
    wait_for(lambda: sched.inbox, what="scan result")
    (r,) = sched.drain()
    assert r.error is None and r.result["first_nonfinite"] is None and sched.scanned[str(step)] == r.signature
    sched.touched(str(step / "a.npy"), now=200.0)
    sched.due(now=300.0)
    assert sched.queue.empty() and not sched.pending    # same signature: not scanned again
    sched.stop()
    assert unit_of("/d/step1/rank0/dump_tensor_data/x.pt") == "/d/step1/rank0"


def test_scheduler_does_not_scan_a_directory_written_moments_ago(tmp_path):
    from precision_agent.dumps.schedule import DumpScheduler
    np.save(tmp_path / "a.npy", np.ones(3, np.float32))  # mtime: now
    sched = DumpScheduler(settle=60.0, queue_size=4, scanned={})
    sched.touched(str(tmp_path / "a.npy"), now=0.0)      # e.g. found by a resync: no event time
    sched.due()
    assert sched.queue.empty() and sched.pending        # still pending until the file is 60 s old


def test_scan_threads_give_the_same_statistics(tmp_path):
    """`scan --threads N` splits each tensor's pass; counts, extremes and sums do not change."""
    import json
    import subprocess
    import sys

    import numpy as np
    rng = np.random.default_rng(5)
    a = rng.standard_normal(3_000_017).astype(np.float32)
    a[[7, 2_000_000]] = [np.nan, np.inf]
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", rng.standard_normal(1_000_003).astype(np.float16))

    def run(*extra):
        out = subprocess.run([sys.executable, "-m", "precision_agent", "scan", "--json", *extra, str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
        return {t["name"]: t for t in json.loads(out.stdout)["tensors"]}

    one, two = run(), run("--threads", "3")
    assert one.keys() == two.keys() == {"a.npy", "b.npy"}
    for name in one:
        for k in ("count", "nan", "pos_inf", "neg_inf", "min", "max", "zero_fraction", "fp16_saturated"):
            assert one[name][k] == two[name][k], (name, k)
        assert abs(one[name]["mean"] - two[name]["mean"]) <= 1e-5 * max(1.0, abs(one[name]["mean"]))
    assert one["a.npy"]["nan"] == 1 and one["a.npy"]["pos_inf"] == 1
    bad = subprocess.run([sys.executable, "-m", "precision_agent", "scan", "--threads", "0", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "threads" in bad.stderr


def test_scan_json_abs_mean_decides_gradient_vanishing(tmp_path):
    # MindInsight's GradientVanishing is mean|g| < 1e-9. This gradient's mean|g| is 0.6e-9 while
    # its RMS is ~3e-9: from the statistics alone the conservative bound could not call it
    # vanishing; the scan's own abs_mean does, and says the basis is exact
    g = np.where(np.arange(4000) % 2 == 0, 5e-10, -5e-10)
    g[::400] = 3e-8  # ten spikes
    d = tmp_path / "rank_0" / "Net" / "0" / "0"
    d.mkdir(parents=True)
    ts = 1_700_000_000_000_000
    np.save(d / f"MatMul.Gradients_Default_net_gradMatMul_MatMul-op9.{ts % 1000}.0.{ts}.output.0.DefaultFormat.npy",
            g.astype(np.float32))
    r = cli_scan(tmp_path)
    (t,) = r["tensors"]
    true = float(np.abs(g.astype(np.float32).astype(np.float64)).mean())
    assert t["abs_mean"] == pytest.approx(true, rel=1e-6) and true < 1e-9 < t["l2norm"] / np.sqrt(t["count"])
    (f,) = [f for f in r["findings"] if f["rule"] == "GradientVanishing"]
    assert f["evidence"]["abs_mean_basis"] == "exact" and f["evidence"]["value"] == pytest.approx(true, rel=1e-6)


@pytest.mark.corpus
def test_msprobe_abs_mean_from_data_not_from_statistics_mode():
    # data mode (.pt files) is scanned: every tensor with finite values has mean|x|; statistics
    # mode (dump.json Max/Min/Mean/Norm) has none, and the watchpoints use bounds there
    data = cli_scan(corpus_path("msprobe", "bench"))["tensors"]
    assert all(t["abs_mean"] is not None and t["abs_mean"] >= 0 for t in data if t["count"])
    assert all(t["abs_mean"] is None for t in cli_scan(corpus_path("msprobe", "stats_bench"))["tensors"])
