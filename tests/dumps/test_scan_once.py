"""`scan` and the scan cache (issue 23 items 4, 8, 9): the fusion-report search near a dump never
fails a clean scan, and a single file is never judged by its siblings; an unreadable tensor before
the first bad op makes its origin uncertain, said in JSON and text; a rescan through the daemon's
cache reads only what changed, and an unchanged unreadable file is not reported anew."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from support.torchpt import write_msprobe_pt
from precision_agent.dumps.cache import ScanCache, cause_of
from precision_agent.dumps.scan import scan_dump
from precision_agent.dumps.schedule import unit_files
from precision_agent.fusion.context import MAX_WALK


def cli(*args):
    return subprocess.run([sys.executable, "-m", "precision_agent", "scan", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def _crowd(folder: Path, n: int) -> None:
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"f{i:06d}.bin").touch()


def test_scan_file_does_not_depend_on_its_siblings(tmp_path):
    """A clean .npz beside a folder of more entries than the fusion search's bound: exit 0, no
    note, the siblings are not walked at all (the search looks only beside the file)."""
    np.savez_compressed(tmp_path / "bomb.npz", a=np.ones((64, 64), np.float32), b=np.zeros(8, np.float16))
    _crowd(tmp_path / "other_job", MAX_WALK + 50)
    p = cli("--json", tmp_path / "bomb.npz")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["errors"] == [] and r["warnings"] == [] and len(r["tensors"]) == 2
    assert "searched the first" not in p.stderr
    # a report beside the file is still found (what a user expects of `scan FILE`)
    (tmp_path / "fusion_result.json").write_text(json.dumps({"graph_fusion": {}}))
    from precision_agent.fusion.context import discover
    assert discover(tmp_path / "bomb.npz").report == tmp_path / "fusion_result.json"
    assert discover(tmp_path / "bomb.npz").cut_short is None


def test_a_cut_fusion_search_is_a_note_never_an_error(tmp_path):
    """`scan DIR` with more entries than the search's bound: the scan stays clean (exit 0); the
    cut search is a note on stderr and under `warnings` in JSON, never under `errors`."""
    np.save(tmp_path / "x.npy", np.ones(16, np.float32))
    _crowd(tmp_path / "big", MAX_WALK + 50)
    p = cli("--json", tmp_path)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["errors"] == [] and len(r["warnings"]) == 1 and f"first {MAX_WALK} entries" in r["warnings"][0]
    assert "note:" in p.stderr and f"first {MAX_WALK} entries" in p.stderr
    text = cli(tmp_path)
    assert text.returncode == 0 and "unreadable" not in text.stdout and "note:" in text.stderr


def _truncated_first(rank_dir: Path) -> Path:
    """msprobe dump: mm's output (the true first NaN) is a truncated .pt; softmax, later, turns
    finite inputs into NaN. Returns the truncated file."""
    one, bad = np.ones(8, np.float32), np.ones(8, np.float32)
    bad[3] = np.nan
    write_msprobe_pt(rank_dir, {
        "Functional.linear.0.forward": {"input_args": [one], "output": [one]},
        "Functional.matmul.0.forward": {"input_args": [one], "output": [bad]},
        "Functional.softmax.0.forward": {"input_args": [one], "output": [bad]},
    })
    pt = rank_dir / "dump_tensor_data" / "Functional.matmul.0.forward.output.0.pt"
    with open(pt, "r+b") as fh:
        fh.truncate(os.path.getsize(pt) // 2)
    return pt


def test_unreadable_tensor_before_the_first_bad_op_makes_its_origin_uncertain(tmp_path):
    rank = tmp_path / "step0" / "rank0"
    pt = _truncated_first(rank)
    p = cli("--json", rank)
    r = json.loads(p.stdout)
    assert p.returncode == 1, p.stderr    # it pages, uncertain or not
    f = r["first_nonfinite"]
    assert (f["op"], f["by"], f["uncertain"]) == ("Functional.softmax.0.forward", "op", True)
    (u,) = f["unreadable_before"]
    assert (u["op"], u["tensor"], u["path"]) == ("Functional.matmul.0.forward", "output[0]", str(pt))
    assert f["unreadable_before_count"] == 1 and u["reason"]
    (finding,) = [x for x in r["findings"] if x["rule"] == "DumpNonFinite"]
    assert "from finite inputs" not in finding["summary"] and "origin uncertain" in finding["summary"]
    assert finding["evidence"]["uncertain"] is True
    text = cli(rank).stdout
    assert "origin uncertain" in text and "Functional.matmul.0.forward output[0]" in text


def test_a_readable_dump_stays_certain(tmp_path):
    """The same dump with the file intact: matmul is the first bad op, nothing uncertain."""
    one, bad = np.ones(8, np.float32), np.ones(8, np.float32)
    bad[0] = np.inf
    rank = tmp_path / "rank0"
    write_msprobe_pt(rank, {"Functional.matmul.0.forward": {"input_args": [one], "output": [bad]},
                            "Functional.softmax.0.forward": {"input_args": [bad], "output": [bad]}})
    p = cli("--json", rank)
    f = json.loads(p.stdout)["first_nonfinite"]
    assert f["op"] == "Functional.matmul.0.forward" and "uncertain" not in f
    (finding,) = [x for x in json.loads(p.stdout)["findings"] if x["rule"] == "DumpNonFinite"]
    assert "produced NaN/Inf from finite inputs" in finding["summary"]


def test_cache_rescans_only_what_changed(tmp_path):
    """The daemon's rescans through the cache: an unchanged file (good or junk) is not read
    again and its error is a replay; a changed one is read and its error is new."""
    for i in range(5):
        np.save(tmp_path / f"t{i}.npy", np.full(4, i, np.float32))
    for i in range(3):
        (tmp_path / f"junk{i}.npy").write_bytes(b"junk")
    cache = ScanCache()
    r1 = scan_dump(tmp_path, files=unit_files(str(tmp_path)), cache=cache)
    assert len(r1["tensors"]) == 5 and len(r1["errors"]) == 3 and len(cache.read) == 8
    assert cache.replayed == set()
    np.save(tmp_path / "t5.npy", np.array([1.0, np.nan], np.float32))
    r2 = scan_dump(tmp_path, files=unit_files(str(tmp_path)), cache=cache)
    assert cache.read == {str(tmp_path / "t5.npy")}
    assert len(r2["tensors"]) == 6 and r2["first_nonfinite"]["op"] == "t5.npy"
    assert {p for p, _ in cache.replayed} == {str(tmp_path / f"junk{i}.npy") for i in range(3)}
    (tmp_path / "junk1.npy").write_bytes(b"other junk, longer")
    scan_dump(tmp_path, files=unit_files(str(tmp_path)), cache=cache)
    assert cache.read == {str(tmp_path / "junk1.npy")}
    small = ScanCache(max_bytes=4000)   # bounded: the oldest entries go, and are read again
    scan_dump(tmp_path, files=unit_files(str(tmp_path)), cache=small)
    assert 0 < small.bytes <= 4000 and 0 < len(small) < 15
    scan_dump(tmp_path, files=unit_files(str(tmp_path)), cache=small)
    assert len(small.read) > 0


def test_unit_files_are_a_folders_own(tmp_path):
    """A dump root's own files (and msprobe's dump_tensor_data/), never a sub-folder's: a file
    is scanned in one unit, under one name."""
    np.save(tmp_path / "a.npy", np.ones(2, np.float32))
    (tmp_path / "step1").mkdir()
    np.save(tmp_path / "step1" / "b.npy", np.ones(2, np.float32))
    (tmp_path / "dump_tensor_data").mkdir()
    np.save(tmp_path / "dump_tensor_data" / "c.npy", np.ones(2, np.float32))
    assert [p.name for p in unit_files(str(tmp_path)).files] == ["a.npy", "c.npy"]


def test_error_causes():
    assert cause_of("/x.npy: truncated npy: 10 bytes, header says 80") == "truncated"
    assert cause_of("/x.npy: cannot read: Permission denied") == "io"
    assert cause_of("/x.npz: zip has 100000 members (limit 4096)") == "limit"
    assert cause_of("/x.npy: bad npy header: junk") == "invalid"


def test_an_unreadable_npy_before_the_first_nan_makes_its_origin_uncertain(tmp_path):
    """A plain .npy tree (file order is execution order): a truncated file before the first NaN."""
    bad = np.ones(64, np.float32)
    bad[5] = np.nan
    np.save(tmp_path / "000_matmul.npy", np.ones(64, np.float32))
    with open(tmp_path / "000_matmul.npy", "r+b") as fh:
        fh.truncate(100)
    np.save(tmp_path / "001_softmax.npy", bad)
    np.save(tmp_path / "002_add.npy", bad)
    r = json.loads(cli("--json", tmp_path).stdout)
    f = r["first_nonfinite"]
    assert f["op"] == "001_softmax.npy" and f["uncertain"] is True
    assert [u["op"] for u in f["unreadable_before"]] == ["000_matmul.npy"]
    # the same file truncated after the first NaN changes nothing
    (tmp_path / "000_matmul.npy").rename(tmp_path / "003_late.npy")
    f = json.loads(cli("--json", tmp_path).stdout)["first_nonfinite"]
    assert f["op"] == "001_softmax.npy" and "uncertain" not in f
