"""Issue 14's first-hour surprises, tried as a new user would, through the real command line:
nested dumps, one bad tree among good ones, exit codes, a closed pipe, a config with several
problems."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from support import dumps as W
from support.dumps import write_msprobe

LINEAR = "Functional.linear.0.forward"


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precision_agent", *map(str, args)], capture_output=True,
                          text=True, timeout=120, **kw)


def scan_json(path: Path, *extra: str) -> tuple[int, dict]:
    p = cli("scan", "--json", path, *extra)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, json.loads(p.stdout)


def _nan_net(root: Path, step: int = 0, rank: str = "rank0") -> Path:
    """An msprobe dump whose linear turns finite inputs into a NaN output."""
    x = np.ones((2, 3), np.float32)
    y = x @ x.T
    y[0, 1] = np.nan
    return write_msprobe(root, [(LINEAR, {"input_args": [x, x.T.copy()], "output": [y]}),
                                ("Torch.relu.0.forward", {"input_args": [y], "output": [y]})], step=step, rank=rank)


# -- 1. nested dump discovery; one bad tree never hides the others ------------------------------------

def test_msprobe_dumps_levels_down_are_found(tmp_path):
    _nan_net(tmp_path / "runs" / "job7" / "attempt2", step=3)      # root/runs/job7/attempt2/step3/rank0
    rc, r = scan_json(tmp_path)
    assert r["layout"] == "msprobe" and len(r["tensors"]) == 5, r
    assert (r["first_nonfinite"]["op"], r["first_nonfinite"]["step"]) == (LINEAR, 3)
    assert rc == 1 and r["findings"][0]["rule"] == "DumpNonFinite"


def test_every_layout_at_any_depth_side_by_side(tmp_path):
    _nan_net(tmp_path / "a" / "msprobe")
    cann = W.ensure_dir(str(tmp_path / "b" / "c" / "d" / "cann" / "rank_0" / "step_4"))
    good = np.ones(4, np.float32)
    W.write_cann_dump(f"{cann}/{W.dump_name('Add', 'layer_add', 1, 0, 1_700_000_000_000)}",
                      inputs=[W.tensor(good)], outputs=[W.tensor(good)])
    deep = tmp_path / "e" / "f" / "g" / "h"
    deep.mkdir(parents=True)
    np.save(deep / "w.npy", np.arange(5, dtype=np.float32))
    rc, r = scan_json(tmp_path)
    assert r["layout"] == "mixed" and r["layouts"] == ["cann", "msprobe", "npy"], r["layouts"]
    names = {t["name"] for t in r["tensors"]}
    assert {LINEAR, "layer_add", "e/f/g/h/w.npy"} <= names and len(r["tensors"]) == 5 + 2 + 1
    assert r["first_nonfinite"]["op"] == LINEAR and rc == 1


def test_a_truncated_dump_json_hides_nothing_else(tmp_path):
    _nan_net(tmp_path / "run", rank="rank0")
    good = _nan_net(tmp_path / "run", rank="rank1")
    bad = tmp_path / "run" / "step0" / "rank0" / "dump.json"
    bad.write_bytes(bad.read_bytes()[:100])                            # truncated mid-write
    other = tmp_path / "elsewhere"
    other.mkdir()
    x = np.zeros(8, np.float32)
    x[3] = np.nan
    np.save(other / "grad.npy", x)
    rc, r = scan_json(tmp_path)
    assert [e["path"] for e in r["errors"]] == [str(bad)], r["errors"]       # the bad tree is named ...
    assert {t["rank"] for t in r["tensors"] if t["name"] == LINEAR} == {1}   # ... its sibling rank is read
    assert any(t["name"] == "elsewhere/grad.npy" and t["nan"] == 1 for t in r["tensors"])  # ... and the NaN found
    assert r["first_nonfinite"] is not None and rc == 1
    assert str(good) in {str(Path(t["path"]).parent.parent) for t in r["tensors"] if t["rank"] == 1}


def test_opdebug_trees_levels_down_next_to_other_dumps(tmp_path):
    from support.dumps import opdebug_two_ranks_two_steps as _two_ranks_two_steps
    _two_ranks_two_steps(tmp_path / "cluster" / "node3" / "npu")            # GE dump trees with Opdebug files
    _nan_net(tmp_path / "cluster" / "node3" / "gpu")                        # and an msprobe run beside them
    rc, r = scan_json(tmp_path)
    assert r["layout"] == "mixed" and {"cann", "msprobe"} <= set(r["layouts"])
    assert [(o["op"], o["step"], o["rank"]) for o in r["overflows"]] == [("add", 1, 0), ("cast", 1, 0)]
    assert rc == 1 and "DumpOverflow" in {f["rule"] for f in r["findings"]}


def test_compare_finds_nested_trees_too(tmp_path):
    _nan_net(tmp_path / "bench" / "deep" / "er")
    _nan_net(tmp_path / "target" / "x")
    p = cli("compare", tmp_path / "bench", tmp_path / "target", "--json")
    doc = json.loads(p.stdout)
    assert doc["pairs"] == 5 and p.returncode == 0, p.stderr
    for side in ("bench", "target"):                                    # a .npy beside them: a mixed tree
        np.save(tmp_path / side / "extra.npy", np.arange(3, dtype=np.float32))
    doc = json.loads(cli("compare", tmp_path / "bench", tmp_path / "target", "--json").stdout)
    assert doc["layouts"] == {"bench": "mixed", "target": "mixed"} and doc["pairs"] == 6 and not doc["unmatched"]


# -- 2. exit codes: 0 clean, 1 findings (page and above by default), 2 errors --------------------------

def test_scan_exit_codes(tmp_path):
    clean = tmp_path / "clean"
    clean.mkdir()
    np.save(clean / "a.npy", np.ones(3, np.float32))
    assert scan_json(clean)[0] == 0
    bad = tmp_path / "bad"
    _nan_net(bad)
    assert scan_json(bad)[0] == 1
    broken = tmp_path / "broken"
    broken.mkdir()
    np.save(broken / "a.npy", np.ones(3, np.float32))
    (broken / "b.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")
    rc, r = scan_json(broken)
    assert rc == 2 and len(r["errors"]) == 1 and len(r["tensors"]) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    p = cli("scan", empty)
    assert p.returncode == 2 and "no dump files found" in p.stderr
    assert cli("scan", tmp_path / "absent").returncode == 2


def test_scan_fail_on_lowers_the_bar(tmp_path):
    zeros = tmp_path / "zeros"
    zeros.mkdir()
    np.save(zeros / "w.npy", np.zeros(16, np.float32))                 # TensorAllZero: a ticket
    rc, r = scan_json(zeros)
    assert [f["severity"] for f in r["findings"]] == ["ticket"] and rc == 0
    assert scan_json(zeros, "--fail-on", "ticket")[0] == 1
    assert scan_json(zeros, "--fail-on", "page")[0] == 0


def _megatron_log(path: Path, iterations: int) -> Path:
    from precision_agent.commands.demo import simulated_job
    simulated_job(path, iterations=iterations, pause=0)
    return path


def test_replay_exit_codes(tmp_path):
    clean = _megatron_log(tmp_path / "clean.log", 8)
    p = cli("replay", clean)
    assert p.returncode == 0, p.stdout + p.stderr
    nan = _megatron_log(tmp_path / "nan.log", 45)                        # loss scale at 1, then NaN grad norm
    p = cli("replay", "--json", nan)
    doc = json.loads(p.stdout)
    assert {"TrainingNonFinite", "LossScaleAtFloor"} <= {f["rule"] for f in doc["findings"]}
    assert p.returncode == 1
    assert cli("replay", tmp_path / "absent.log").returncode == 2
    unreadable = tmp_path / "dir.log"
    unreadable.mkdir()
    assert cli("replay", unreadable).returncode == 2


# -- 3. a closed pipe ends quietly -------------------------------------------------------------------

def _read_one_line_then_close(args: list[str]) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "precision_agent", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first, "no output at all"
    proc.stdout.close()                                                  # what `| head -1` does
    err = proc.stderr.read()
    return proc.wait(60), err


def test_closed_pipe_gives_no_traceback(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(300):                                                 # ~200 KB of JSON: more than a pipe holds
        np.save(tree / f"t{i:03d}.npy", np.full(4, i, np.float32))
    bench = tmp_path / "bench"
    bench.mkdir()
    for i in range(300):
        np.save(bench / f"t{i:03d}.npy", np.full(4, i + 0.5, np.float32))
    for args in (["scan", "--json", tree], ["compare", "--json", bench, tree]):
        rc, err = _read_one_line_then_close(args)
        assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, (args, err)
        # 141 = 128 + SIGPIPE, as a shell reports `yes | head`; compare writes its JSON in one call,
        # which a closed pipe cuts short without an error, so it may end with its own status (1)
        assert rc == 141 or (args[0] == "compare" and rc == 1), (args, rc, err)


# -- 4. a config file with several problems names them all --------------------------------------------

def test_bad_config_names_every_problem(tmp_path):
    path = tmp_path / "agent.yml"
    path.write_text("listen: nonsense\n"
                    "watches:\n"
                    "  - path: /x\n    kind: bogus\n    format: custom\n"        # a field and a cross-field check
                    "  - path: /y\n    format: custom\n    pattern: '(unclosed'\n"  # a bad regex, not a missing one
                    "  - path: /z\n    poll_interval: 1ms\n"
                    "limits: {nice: 99, max_series: 0}\n"
                    f"rule_dirs: [{tmp_path / 'no1'}, {tmp_path / 'no2'}]\n"
                    "listne: 1\n")
    p = cli("run", "--config", path)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(f"{path}: ")]
    fields = [ln[len(str(path)) + 2:].split(": ", 1)[0] for ln in lines]
    assert sorted(fields) == sorted(["listen", "watches.0.kind", "watches.0", "watches.1.pattern",
                                     "watches.2.poll_interval", "limits.nice", "limits.max_series",
                                     "rule_dirs", "listne"]), p.stderr
    text = p.stderr
    assert "needs a 'pattern'" in text and text.count("needs a 'pattern'") == 1     # only the watch without one
    assert "no1" in text and "no2" in text and "9 problems" in text


# -- 5. output a person can read ---------------------------------------------------------------------

def test_scan_table_shows_full_names_and_no_none(tmp_path):
    stem = "Module.transformer.encoder.layers.11.self_attention.core_attention"   # 66 characters
    for tail in ("query", "key"):
        x = np.ones(4, np.float32)
        x[1] = np.nan
        np.save(tmp_path / f"{stem}.{tail}.npy", x)
    p = cli("scan", tmp_path)
    assert p.returncode == 1
    rows = [ln for ln in p.stdout.splitlines() if ln.endswith(".npy output[0]") and "first bad op" not in ln]
    assert len(rows) == 2 and len(set(rows)) == 2, p.stdout
    assert any(ln.endswith(f"{stem}.query.npy output[0]") for ln in rows), p.stdout
    assert "None" not in p.stdout, p.stdout                     # a .npy tree has no step or rank: "-"


def test_inf_in_max_and_min_as_msprobe_writes_them(tmp_path):
    x = np.array([[1.0, np.inf], [-2.0, 3.0]], np.float32)
    y = np.array([-np.inf, 0.5], np.float32)
    entries = [(LINEAR, {"input_args": [np.ones(2, np.float32)], "output": [x, y]})]
    write_msprobe(tmp_path / "tensor", entries)
    write_msprobe(tmp_path / "stats", entries, task="statistics")
    _, full = scan_json(tmp_path / "tensor")
    _, stats = scan_json(tmp_path / "stats")
    extremes = lambda r: [(t["max"], t["min"]) for t in r["tensors"] if t["io"] == "output"]  # noqa: E731
    assert extremes(full) == [("+Inf", -2.0), (0.5, "-Inf")] == extremes(stats)
    out = [t for t in full["tensors"] if t["io"] == "output"]
    assert (out[0]["finite_max"], out[1]["finite_min"]) == (3.0, 0.5)   # the scanner's finite-only values
    text = cli("scan", tmp_path / "tensor").stdout
    row = next(ln for ln in text.splitlines() if ln.endswith("output[0]") and LINEAR in ln and "first" not in ln)
    assert row.split()[5:7] == ["inf", "-2"], text


def test_failing_cosine_has_the_digits_that_show_why(tmp_path):
    from support.dumps import tiny_net as _net
    _net(tmp_path / "bench")
    _net(tmp_path / "drift", half_fc2=True)
    p = cli("compare", tmp_path / "bench", tmp_path / "drift")
    assert p.returncode == 1
    row = next(ln for ln in p.stdout.splitlines() if ln.endswith("Functional.linear.1.forward output[0]"))
    cosine = row.split()[2]
    assert cosine != "1" and float(cosine) < 1.0 and cosine.startswith("0.9999"), p.stdout


def test_statistics_compare_shows_what_statistics_allow(tmp_path):
    from support.dumps import tiny_net as _net
    _net(tmp_path / "bench", task="statistics")
    _net(tmp_path / "drift", half_fc2=True, task="statistics")
    p = cli("compare", tmp_path / "bench", tmp_path / "drift")
    assert p.returncode == 1, p.stderr
    table = p.stdout.split("statistics only", 1)[1]
    assert "cosine, RED and max|Δ| cannot be computed" in table and "max rel" in table
    row = next(ln for ln in table.splitlines() if ln.endswith("Functional.linear.1.forward output[0]"))
    assert "nan" not in row.lower() and "%" in row, p.stdout
    doc = json.loads(cli("compare", "--json", tmp_path / "bench", tmp_path / "drift").stdout)
    assert doc["statistics_only"]["pairs"] == doc["pairs"]
    assert "CosineSimilarity" in doc["statistics_only"]["unavailable"]
    assert {r["compared_on"] for r in doc["rows"]} == {"statistics"}


# -- 7. no leaked temporary folders; a clean build --------------------------------------------------

def test_demo_removes_its_folder_on_sigterm(tmp_path):
    from conftest import free_port, wait_for
    import os
    import signal
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "precision_agent", "demo", "--listen",
                             f"127.0.0.1:{free_port()}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        first = proc.stdout.readline()
        assert first.startswith("precision-agent demo: watching "), first
        folder = Path(first.split("watching ", 1)[1].strip()).parent
        assert folder.parent == tmp_path and folder.is_dir()
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "firing at exit" in rest
    wait_for(lambda: not folder.exists(), timeout=5, what="the demo's folder to be gone")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("precision-agent-demo-")]


# -- 6. progress counted in bytes (scan, compare) and in bytes and lines (replay) ---------------------

def test_scan_progress_moves_inside_one_big_tensor(tmp_path):
    import re
    np.save(tmp_path / "big.npy", np.ones(24 << 20, np.float32))          # 96 MiB: one tensor
    p = cli("scan", "--progress", tmp_path)
    assert p.returncode == 0, p.stderr
    frames = p.stderr.replace("\r", "\n").splitlines()
    inside = [f for f in frames if re.search(r"\] \d+\.\d MiB/96\.0 MiB, 0/1 tensors$", f)]
    assert inside, p.stderr                                                 # bytes move before the tensor is done
    assert frames[-1].endswith("96.0 MiB/96.0 MiB, 1/1 tensors"), p.stderr


def test_compare_progress_counts_bytes_and_pairs(tmp_path):
    from support.dumps import tiny_net as _net
    _net(tmp_path / "bench")
    _net(tmp_path / "drift", half_fc2=True)
    p = cli("compare", "--progress", tmp_path / "bench", tmp_path / "drift")
    last = p.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("comparing [###") and "KiB/" in last and last.endswith("12/12 pairs"), p.stderr


def test_replay_progress(tmp_path):
    log = _megatron_log(tmp_path / "train.log", 30)
    p = cli("replay", "--progress", log)
    assert p.returncode == 1, p.stderr                                      # the loss scale reached its floor
    last = p.stderr.replace("\r", "\n").strip().splitlines()[-1]
    size = log.stat().st_size
    assert last.startswith("replaying [###") and last.endswith("31 lines"), p.stderr
    assert f"/{size / 1024:.1f} KiB" in last, (last, size)
    assert "replaying" not in cli("replay", log).stderr                     # no tty, no bar


def test_npy_conversions_beside_cann_dumps_are_not_a_second_tree(tmp_path):
    d = W.ensure_dir(str(tmp_path / "deep" / "dump" / "20240301120000" / "0"))
    one = np.ones(4, np.float32)
    name = W.dump_name("Add", "layer_add", 1, 0, 1_700_000_000_000)
    W.write_cann_dump(f"{d}/{name}", inputs=[W.tensor(one)], outputs=[W.tensor(one)])
    np.save(f"{d}/{name}.output.0.npy", one)                     # what msaccucmp's convert leaves beside it
    rc, r = scan_json(tmp_path)
    assert r["layout"] == "cann" and len(r["tensors"]) == 2 and rc == 0, r
