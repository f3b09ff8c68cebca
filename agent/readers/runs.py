"""Run identity: which run a followed log file belongs to, as a bounded, path-free ``run`` label.

Two runs whose logs share a watched folder must not become one series (the second run's lines
would resolve the first run's page and its loss scale would "increase" from 1 to 65536). By
default each file is its own run, named after the file; rotated generations of one file
(``train.log.1``, ``train.log-20250101``) are the same run. ``run_from: parent_dir`` names the run
after the folder holding the file (one folder per run, several files in it); ``run_from: label``
takes only the watch's labels (the agent adds none). A watch whose ``labels`` set ``run`` keeps it.

A structured metric file (TensorBoard ``events.out.tfevents.*``, a CSV metric log) is named by its
writer, not by the user, and a run's folder often holds several (one per restart): by default its
run is the folder, as the writers lay them out: HF Trainer ``runs/<date>_<host>`` (the folder
name), Lightning ``<save_dir>/<name>/version_N`` (all three, ``exp1_lightning_logs_version_3``:
every experiment has a ``version_0``).

A file named per rank (``train_rank3.log``, ``rank-3.out``) is one rank of its run: the token
becomes the ``rank`` label (unless the lines carry torchrun's ``[rank3]:`` prefixes, which win)
and is left out of the run's name.
"""

from __future__ import annotations

import hashlib
import os
import re

RUN_FROM = ("file", "parent_dir", "label")
MAX_RUN_LEN = 64

# logrotate (.1, -20250101), Python's RotatingFileHandler (.1) and TimedRotatingFileHandler
# (.2025-01-01, .2025-01-01_13-00), backups
_ROTATION_RE = re.compile(r"(?:\.\d{1,4}|[-_.]\d{8}(?:[-_T]?\d{4,6})?|\.\d{4}-\d\d-\d\d(?:_\d\d(?:-\d\d){0,2})?"
                          r"|\.(?:old|bak|prev))$")
_EXT_RE = re.compile(r"\.(?:log|txt|out|err|jsonl|json|stdout|stderr)$", re.IGNORECASE)
_RANK_RE = re.compile(r"(?:^|[-_.])rank[-_]?(\d{1,6})(?=$|[-_.])", re.IGNORECASE)
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.:-]+")


def _bounded(name: str) -> str:
    name = _UNSAFE_RE.sub("_", name).strip("_.-") or "log"
    return _bounded_path(name)


def file_run(path: str) -> tuple[str, str | None]:
    """``(run, rank)`` from a file name: rotation suffix and extension dropped, a rank token taken out."""
    name = os.path.basename(path)
    while True:  # train.log.1, train.log.2024-01-01, train.log.1.bak
        stripped = _ROTATION_RE.sub("", name)
        if stripped == name or not stripped:
            break
        name = stripped
    name = _EXT_RE.sub("", name) or name
    rank = None
    m = _RANK_RE.search(name)
    if m:
        rank = str(int(m.group(1)))
        name = (name[:m.start()] + name[m.end():]).strip("-_.") or "rank"
    return _bounded(name), rank


_STRUCTURED_RE = re.compile(r"^events\.out\.tfevents\.|\.csv$", re.IGNORECASE)
_VERSION_RE = re.compile(r"^version_\d+$")


def folder_run(path: str) -> str:
    """The run of a structured metric file: its folder; for Lightning's ``version_N`` the two
    folders above too (``<save_dir>/<name>/version_N``: every experiment has a ``version_0``, and
    the default name ``lightning_logs`` is everyone's)."""
    folder = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(folder)
    if _VERSION_RE.match(name):
        parent = os.path.dirname(folder)
        parts = [os.path.basename(os.path.dirname(parent)), os.path.basename(parent), name]
        name = "_".join(p for p in parts if p)
    return _bounded(name)


def _in_folder(run: str, path: str, root: str | None) -> str:
    """``run`` of a file below the watched folder ``root`` (not directly in it), prefixed with its
    folders there: ``job1/train.log`` and ``job2/train.log`` are two runs (``job1/train``,
    ``job2/train``), and ``job1/rank0.log`` is rank 0 of run ``job1``. A file directly in the
    watched folder keeps its own name."""
    if root is None:
        return run
    folder, top = os.path.dirname(os.path.abspath(path)), os.path.abspath(root)
    if folder == top or not folder.startswith(top.rstrip(os.sep) + os.sep):
        return run
    parts = [_UNSAFE_RE.sub("_", p).strip("_.-") or "_" for p in os.path.relpath(folder, top).split(os.sep)]
    if run != "rank":   # "rank": the name was nothing but its rank token
        parts.append(run)
    return _bounded_path("/".join(parts))


def _bounded_path(name: str) -> str:
    if len(name) <= MAX_RUN_LEN:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:MAX_RUN_LEN - 9]}~{digest}"


def run_labels(path: str, run_from: str, labels: dict[str, str], root: str | None = None) -> dict[str, str]:
    """The labels a followed file's series carry: the watch's, plus ``run`` (and a file's rank).
    ``root``: the watched folder (a file in a sub-folder of it is named with that folder, so that
    runs laid out one folder each, all writing ``train.log``, stay apart)."""
    out = dict(labels)
    if run_from == "label" or "run" in out:
        return out
    if run_from == "parent_dir":
        out["run"] = _bounded(os.path.basename(os.path.dirname(os.path.abspath(path))))
        return out
    if _STRUCTURED_RE.search(os.path.basename(path)):
        out["run"] = folder_run(path)
        return out
    run, rank = file_run(path)
    out["run"] = _in_folder(run, path, root)
    if rank is not None and "rank" not in out:
        out["rank"] = rank
    return out


# The levels a dump tool puts below its dump root, matched exactly, innermost level last (the
# scanned unit): a bare number above them is someone's folder (a SLURM job id, Hydra's
# multirun/<date>/<time>/<n>), i.e. another run, never a level to climb.
_DIGITS = r"[0-9]+"
_ANY = r"[^/]+"
_DUMP_LAYOUTS = (
    ("msprobe", (r"step[0-9]+", r"rank[0-9]*|proc[0-9]+")),                            # step3/rank1
    ("CANN", (r"(?:19|20)[0-9]{12}", _DIGITS, _ANY, _DIGITS, _DIGITS)),   # {time}/{device}/{model}/{id}/{iter}
    ("CANN single op", (r"(?:19|20)[0-9]{12}", _DIGITS)),                              # {time}/{device}
    ("MindSpore", (r"rank_[0-9]+", _ANY, _DIGITS, _DIGITS)),        # rank_{id}/{net}/{graph}/{iteration}
    ("steps", (r"(?:step|iter|iteration)[_-]?[0-9]+",)),                    # a tree of .npy files per step
)
_DUMP_LEVELS = [(name, [re.compile(p, re.IGNORECASE if name == "steps" else 0) for p in levels])
                for name, levels in _DUMP_LAYOUTS]


def _layout_depth(parts: list[str]) -> int:
    """How many trailing ``parts`` (of a scanned directory) are the levels of one dump tool's layout."""
    for _name, levels in _DUMP_LEVELS:
        tail = parts[len(parts) - len(levels):] if len(parts) >= len(levels) else []
        if tail and all(p.fullmatch(t) for p, t in zip(levels, tail)):
            return len(levels)
    return 0


def dump_root(unit: str, watch_path: str) -> str:
    """The dump root of a scanned dump directory: the folder above the levels of the layout it is
    found in (msprobe ``step<N>/rank<N>|proc<N>``, CANN ``<time>/<device>/<model>/<model id>/<iter>``,
    MindSpore ``rank_<id>/<net>/<graph>/<iteration>``), the directory itself when it is in none;
    never above the watched path."""
    top = os.path.abspath(watch_path)
    d = os.path.abspath(unit)
    if d != top and not d.startswith(top.rstrip(os.sep) + os.sep):
        return d
    parts = d.split(os.sep)
    root = os.sep.join(parts[:len(parts) - _layout_depth(parts)]) or os.sep
    return top if len(root) < len(top) else root


def dump_run_labels(unit: str, watch_path: str, run_from: str, labels: dict[str, str]) -> dict[str, str]:
    """The labels of a dump watch's findings: the watch's, plus ``run`` = the dump root's name
    (the watched folder's own name when the dumps lie directly in it). ``run_from: label`` or a
    ``run`` among the watch's labels: only the watch's labels."""
    out = dict(labels)
    if run_from == "label" or "run" in out:
        return out
    out["run"] = _bounded(os.path.basename(dump_root(unit, watch_path)) or "dump")
    return out
