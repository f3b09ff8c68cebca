"""dumps/discovery.py: which files of a tree lie outside its msprobe rank folders, by path text
(fast) exactly as by Path ancestry, for relative and absolute trees alike."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from precision_agent.compare.pairing import read_side
from precision_agent.dumps.discovery import _outside
from support.dumps import tiny_net


def _by_parents(files: list[Path], roots: set[Path]) -> list[Path]:
    return [f for f in files if not any(p in roots for p in f.parents)]


FILES = ["run/step0/rank0/dump.json", "run/step0/rank0/dump_tensor_data/a.pt", "run/step0/rank01/b.pt",
         "run/step0/rank0x", "run/step0/rank1/c.pt", "other/rank0/d.pt", "../up/rank0/e.pt", "x/../run/rank0/f.pt",
         "top.pt", "./run/step0/rank0/g.pt"]
ROOTS = ["run/step0/rank0", "run/step0/rank1", "run", ".", "../up", "../up/rank0", "x/..", "x/../run/rank0",
         "/", "/work", "run/step0/rank0/dump_tensor_data"]


def test_files_outside_roots_by_text_are_those_by_ancestry():
    for base in ("", "/data/dumps/"):           # relative trees, and the same under an absolute root
        files = [Path(base + f) for f in FILES]
        for n in (1, 2, 3):
            for combo in itertools.combinations(ROOTS, n):
                roots = {Path(base + r) if not r.startswith("/") else Path(r) for r in combo}
                assert _outside(files, roots) == _by_parents(files, roots), (base, combo)
    mixed = [Path("/abs/rank0/a.pt"), Path("rel/rank0/b.pt")]
    for roots in ({Path("/abs/rank0")}, {Path("rel/rank0")}, {Path("/abs/rank0"), Path("rel/rank0")}):
        assert _outside(mixed, roots) == _by_parents(mixed, roots)


def test_a_relative_tree_reads_as_the_absolute_one(tmp_path, monkeypatch):
    tiny_net(tmp_path / "bench")
    (tmp_path / "bench" / "notes.txt").write_text("not a dump")
    monkeypatch.chdir(tmp_path)
    rel, ab = read_side("bench"), read_side(str(tmp_path / "bench"))
    assert len(rel.tensors) == len(ab.tensors) == 12
    assert [(t.name, t.io, t.index, os.path.abspath(t.path)) for t in rel.tensors] == \
        [(t.name, t.io, t.index, t.path) for t in ab.tensors]
    assert [os.path.basename(p) for p, _ in rel.errors] == [os.path.basename(p) for p, _ in ab.errors]
