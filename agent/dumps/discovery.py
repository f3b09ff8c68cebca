"""Find every dump under a path, at any depth, one tree at a time.

A folder handed to ``scan`` or ``compare`` may hold the dumps themselves or keep them some
levels down (``runs/job7/step0/rank0/dump.json``, ``dump/20240301120000/1/ge_default/…``), and
may hold several kinds side by side. The walk sorts every file into the trees it belongs to:

- msprobe: each directory holding a ``dump.json`` is one rank (or ``proc<PID>``) directory;
  every file below it (``dump_tensor_data/``, ``stack.json``, ...) belongs to it;
- CANN binary dumps (and Opdebug files): one tree per directory of dump-named files (other files
  in that directory, such as ``.npy`` conversions of those dumps, belong to it);
- MindSpore: one tree per directory of MindSpore-named ``.npy`` files, and each ``statistic.csv``;
- everything else that ends in ``.npy`` / ``.npz``: one tree per file.

Each tree is read on its own: one that cannot be read (a truncated ``dump.json``, a directory
that cannot be listed) adds an error naming it and never hides the others. The layout is the
kind of the trees found (``mixed`` when there are several kinds; each tensor then says its own
in ``extra["layout"]``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..health import beat
from .msprobe import read_msprobe_rank_dir
from .npy import read_npy, read_npz
from .types import DumpError, DumpTensor

if TYPE_CHECKING:
    from .cache import ScanCache
# the CANN and MindSpore readers are imported where a tree has files outside msprobe's rank folders

MAX_FILES = 200_000  # bound the walk of a hostile or mistaken tree
MAX_STANDINS = 10_000  # stand-ins for unreadable plain files kept per scan (file order: the earliest)
KINDS = ("msprobe", "cann", "mindspore", "npy")   # reading order and the layout's precedence
_STEP = re.compile(r"step(\d+)")
_RANK = re.compile(r"rank(\d*)|proc(\d+)")
Unreadable = list[tuple[DumpTensor, str]]   # a tensor (or a stand-in) that could not be read, and why


@dataclass(slots=True)
class Walk:
    """The regular files under a path (sorted, bounded) and what kept the walk from others."""

    files: list[Path] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)


def walk(root: Path, max_files: int = MAX_FILES) -> Walk:
    """Every file under ``root`` (``root`` itself when it is a file), in sorted order."""
    out = Walk()
    if not root.is_dir():
        out.files.append(root)
        return out

    def failed(exc: OSError) -> None:
        out.errors.append((str(exc.filename or root), f"cannot list: {exc.strerror or exc}"))

    for dirpath, dirnames, filenames in os.walk(root, onerror=failed):
        dirnames.sort()
        for name in sorted(filenames):
            if len(out.files) >= max_files:
                out.errors.append((str(root), f"stopped after {max_files} files: the rest of the tree "
                                              "was not read (scan a smaller directory)"))
                return out
            out.files.append(Path(dirpath) / name)
    return out


def _number(name: str, pattern: re.Pattern) -> int:
    m = pattern.fullmatch(name)
    digits = next((g for g in m.groups() if g), "") if m else ""
    return int(digits) if digits else -1


def _msprobe_order(rank_dir: Path) -> tuple:
    return (str(rank_dir.parent.parent), _number(rank_dir.parent.name, _STEP),
            _number(rank_dir.name, _RANK), rank_dir.name)


def _outside(files: list[Path], roots: set[Path]) -> list[Path]:
    """The files under none of ``roots``, by their text, which a Path keeps normalised (a Path
    per parent of every file cost more than reading the rest of an msprobe tree's description):
    when all are absolute (a walk of an absolute root) or all relative (``compare bench/ run/``),
    and no root is "/" or "." (whose text is no prefix of the files under it)."""
    anchored = {r.is_absolute() for r in roots} | {f.is_absolute() for f in files}
    if len(anchored) == 1 and all(r != r.parent for r in roots):
        prefixes = tuple(str(r) + os.sep for r in roots)     # "/a/rank0/", "a/rank0/"
        return [f for f in files if not str(f).startswith(prefixes)]
    return [f for f in files if not any(p in roots for p in f.parents)]


def _read_msprobe(dirs: list[Path], errors: list[tuple[str, str]]) -> list[DumpTensor]:
    out: list[DumpTensor] = []
    for d in sorted(dirs, key=_msprobe_order):
        try:
            out.extend(read_msprobe_rank_dir(d))
        except DumpError as exc:
            errors.append((str(d / "dump.json"), str(exc)))
    return out


def _read_cann(files: list[Path], errors: list[tuple[str, str]]) -> list[DumpTensor]:
    """Tensors of every CANN dump directory, with step and rank from the directory's path; the
    execution order runs on across directories of the same (step, rank)."""
    from .cann import dump_dir_location, list_dump_dir
    tensors: list[DumpTensor] = []
    next_order: dict[tuple, int] = {}
    for d in sorted({str(f.parent) for f in files}):
        try:
            found, errs = list_dump_dir(d)
        except (DumpError, OSError) as exc:
            errors.append((d, str(exc)))
            continue
        step, rank = dump_dir_location(d)
        base = next_order.get((step, rank), 0)
        for t in found:
            t.step, t.rank, t.order = step, rank, base + t.order
        if found:
            next_order[(step, rank)] = found[-1].order + 1
        tensors.extend(found)
        errors.extend(errs)
    return tensors


def _read_mindspore(dirs: list[str], csvs: list[Path], errors: list[tuple[str, str]]) -> list[DumpTensor]:
    from .mindspore import read_mindspore_npy_dir, read_statistic_csv
    tensors: list[DumpTensor] = []
    for d in dirs:
        try:
            tensors.extend(read_mindspore_npy_dir(d))
        except (DumpError, OSError) as exc:
            errors.append((d, str(exc)))
    for c in csvs:
        try:
            tensors.extend(read_statistic_csv(c))
        except (DumpError, OSError) as exc:
            errors.append((str(c), str(exc)))
    return tensors


def _read_plain(f: Path, base: Path) -> tuple[list[DumpTensor], list[tuple[str, str]]]:
    try:
        if f.suffix == ".npy":
            return [read_npy(f, name=str(f.relative_to(base)))], []
        return read_npz(f), []
    except (DumpError, OSError) as exc:
        return [], [(str(f), str(exc))]


def _read_npy(files: list[Path], base: Path, errors: list[tuple[str, str]],
              cache: ScanCache | None = None, unreadable: Unreadable | None = None) -> list[DumpTensor]:
    """Each plain ``.npy``/``.npz`` file is a tree of its own, in file order; ``cache``: an
    unchanged file is answered from the daemon's cache (agent/dumps/cache.py), never read again.
    ``unreadable``: gets a stand-in for each file that cannot be read, at its place in the order
    (it may hold the first NaN: agent/dumps/scan.py first_bad_op)."""
    tensors: list[DumpTensor] = []
    order = 0
    for f in files:
        beat()   # a folder of many small files is progress, not a hang
        found = cache.file(str(f)) if cache is not None else None
        if found is None:
            found = _read_plain(f, base)
            if cache is not None:
                cache.put_file(str(f), *found)
        for t in found[0]:
            t.order, t.io, order = order, t.io or "output", order + 1
        tensors.extend(found[0])
        errors.extend(found[1])
        if found[1] and not found[0]:
            if unreadable is not None and len(unreadable) < MAX_STANDINS:   # the earliest ones matter
                unreadable.append((DumpTensor(name=str(f.relative_to(base)) if f.is_relative_to(base) else f.name,
                                              io="output", index=0, dtype="", shape=(), order=order,
                                              path=str(f)), found[1][0][1]))
            order += 1
    return tensors


def discover(path: Path, files: list[Path] | None = None, cache: ScanCache | None = None,
             unreadable: Unreadable | None = None) -> tuple[list[DumpTensor], list[tuple[str, str]], str]:
    """All tensors under ``path`` (tree by tree, each in execution order), the unreadable files
    and trees with their reasons, and the layout (see the module docstring). ``files``: those
    to sort (default: every file under ``path``); ``cache``: the daemon's per-file cache;
    ``unreadable``: gets a stand-in (with why) for each plain file that could not be read."""
    errors: list[tuple[str, str]] = []
    if files is None:
        w = walk(path)
        files, errors = w.files, w.errors
    rank_dirs = {f.parent for f in files if f.name == "dump.json"}
    rest = _outside([f for f in files if f.name != "dump.json"], rank_dirs) if rank_dirs else files
    if not rest:
        return _found({"msprobe": _read_msprobe(list(rank_dirs), errors)} if rank_dirs else {}, errors)
    from .cann import parse_dump_name
    from .mindspore import parse_npy_name
    cann = [f for f in rest if parse_dump_name(f.name)]
    if cann:   # .npy files beside CANN dumps are their conversions (msaccucmp, precision_tool): not a tree
        cann_dirs = {f.parent for f in cann}
        rest = [f for f in rest if f.parent not in cann_dirs]
    ms_dirs = sorted({str(f.parent) for f in rest if f.suffix == ".npy" and parse_npy_name(f.name)})
    csvs = [f for f in rest if f.name == "statistic.csv"]
    plain = [f for f in rest if f.suffix in (".npy", ".npz") and not parse_npy_name(f.name)]
    found: dict[str, list[DumpTensor]] = {}
    if rank_dirs:
        found["msprobe"] = _read_msprobe(list(rank_dirs), errors)
    if cann:
        found["cann"] = _read_cann(cann, errors)
    if ms_dirs or csvs:
        found["mindspore"] = _read_mindspore(ms_dirs, csvs, errors)
    if plain:
        found["npy"] = _read_npy(plain, path if path.is_dir() else path.parent, errors, cache, unreadable)
    return _found(found, errors)


def _found(found: dict[str, list[DumpTensor]], errors: list[tuple[str, str]],
           ) -> tuple[list[DumpTensor], list[tuple[str, str]], str]:
    """discover's answer from the tensors of each kind of tree found."""
    if not found:
        return [], errors, "npy"   # nothing recognised: an (empty) .npy tree, as before
    kinds = [k for k in KINDS if k in found]
    if len(kinds) == 1:
        return found[kinds[0]], errors, kinds[0]
    tensors = []
    for k in kinds:
        for t in found[k]:
            t.extra["layout"] = k
            tensors.append(t)
    return tensors, errors, "mixed"
