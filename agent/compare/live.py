"""What the daemon does with a completed dump directory besides scanning it: compare it with the
same directory of the benchmark run (or the rerun), and digest the tensors that must be equal on
every data-parallel rank.

Runs on the dump-scan thread (it reads tensors); the worker thread only turns the outcome into
samples. The other side is matched by relative path: ``<watch root>/step3/rank0`` pairs with
``<against>/step3/rank0``. If the other side has not finished that step yet, the step waits and is
tried again later, never compared half-written.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import CompareSpec
from ..dumps.samples import fusion_attrs
from ..dumps.schedule import AfterScan, RankDigest, signature
from ..model import DUMP_DIVERGENCE, DUMP_NONDETERMINISM, Sample, SourcePos, json_safe, make_labels
from .digest import step_digests
from .engine import compare_sides
from .pairing import Side, read_side
from .report import to_json, write_csv

MAX_CSV_FILES = 500   # per csv directory: the oldest tables go first


@dataclass(frozen=True, slots=True)
class DumpWork:
    """A dump watch's extra duties, taken from its config."""

    root: Path
    compare: CompareSpec | None
    digest: str | None
    csv_dir: Path
    fusion: Any = None   # the job's fusion report and executed graph (daemon/fusionfiles.py), for compare

    @property
    def needed(self) -> bool:
        return self.compare is not None or self.digest is not None


def counterpart(unit: str, work: DumpWork) -> Path | None:
    """The other run's directory for ``unit`` (None when ``unit`` is not under the watch root)."""
    if work.compare is None:
        return None
    rel = os.path.relpath(unit, work.root)
    if rel.startswith(".."):
        return None
    other = work.compare.against if rel == "." else work.compare.against / rel
    if not other.exists() and _PROC.fullmatch(other.name) and other.parent.is_dir():
        # msprobe names a run without ranks proc<PID>: another process, another name
        procs = [p for p in other.parent.iterdir() if _PROC.fullmatch(p.name) and p.is_dir()]
        if len(procs) == 1:
            return procs[0]
    return other


_PROC = re.compile(r"proc\d+")


def ready(path: Path, settle: float, now: float | None = None) -> bool:
    """The other side exists and nothing in it changed for ``settle`` seconds."""
    sig = signature(str(path))
    return sig is not None and (now if now is not None else time.time()) - sig[2] / 1e9 >= settle


def _csv_name(unit: str, work: DumpWork) -> str:
    rel = os.path.relpath(unit, work.root)
    return (re.sub(r"[^A-Za-z0-9_.-]+", "_", rel.replace(os.sep, "__")).strip("._") or "root") + ".csv"


def _write_csv(res: Any, unit: str, work: DumpWork) -> tuple[str | None, str | None]:
    """(path, None) once written, or (None, reason): the caller counts the error."""
    try:
        work.csv_dir.mkdir(parents=True, exist_ok=True)
        path = work.csv_dir / _csv_name(unit, work)
        tmp = path.with_suffix(".csv.tmp")
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            write_csv(res, fh)
        os.replace(tmp, path)
        tables = sorted(work.csv_dir.glob("*.csv"), key=lambda p: p.stat().st_mtime)
        for old in tables[:-MAX_CSV_FILES]:
            old.unlink(missing_ok=True)
        return str(path), None
    except OSError as exc:
        return None, f"cannot write the comparison table in {work.csv_dir}: {exc.strerror or exc}"


def compare_unit(unit: str, other: Path, work: DumpWork, target: Side | None = None) -> dict[str, Any]:
    """Compare ``unit`` (target, read here unless given) with ``other`` (benchmark or rerun);
    JSON-safe result + CSV path."""
    spec = work.compare
    assert spec is not None
    res = compare_sides(target if target is not None else read_side(unit), read_side(other),
                        preset=spec.preset, rerun=spec.mode == "rerun", fusion=work.fusion)
    out = json_safe(to_json(res))
    out["csv"], csv_error = _write_csv(res, unit, work)
    if csv_error is not None:
        out["csv_error"] = csv_error
    return out


_STEP_DIR = re.compile(r"^(?:step|iter|iteration)[_-]?(\d+)$", re.IGNORECASE)


def path_step(unit: str, root: Path) -> int | None:
    """The step a directory names (``…/step12/…``), for layouts whose files do not say it."""
    for part in reversed(Path(os.path.relpath(unit, root)).parts):
        m = _STEP_DIR.match(part)
        if m:
            return int(m.group(1))
    return None


def after_scan(unit: str, work: DumpWork, settle: float) -> AfterScan:
    """Digest and comparison of a freshly scanned directory (run on the scan thread)."""
    out = AfterScan()
    target = read_side(unit)  # discovered once, for the digest and the comparison
    if work.digest is not None:
        step = path_step(unit, work.root)
        out.digests = [RankDigest(d.rank, d.step if d.step is not None else step, d.value, d.tensors)
                       for d in step_digests(target.tensors, work.digest)]
    other = counterpart(unit, work)
    if other is not None:
        if ready(other, settle):
            res = out.compare = compare_unit(unit, other, work, target)
            res.setdefault("step", path_step(unit, work.root))   # a match's step, for the incident kinds
            ranks = {t.rank for t in target.tensors}
            if len(ranks) == 1 and None not in ranks:
                res.setdefault("rank", ranks.pop())                # and its rank
            sig = signature(unit)   # when the unit was written: how the incident kinds tell a restart
            res["written"] = sig[2] / 1e9 if sig is not None else None
            for key in ("first_diverging_op", "corrupted_input", "first_differing_tensor"):
                where = res.get(key)
                if where and where.get("step") is None:
                    where["step"] = path_step(unit, work.root)
        else:
            out.waiting_for = str(other)
    return out


def compare_sample(result: dict[str, Any], labels: dict[str, str], unit: str) -> Sample:
    """The sample of a comparison (value 1: diverged; in rerun mode any bitwise difference; 0: it
    matched), labelled like the watch (+ rank).

    The op to look at first: the op that lost precision, else the op whose input already
    differed, else the first differing tensor's op."""
    where = result.get("first_diverging_op") or result.get("corrupted_input") \
        or result.get("first_differing_tensor") or {}
    ls = dict(labels)
    rank = where.get("rank") if where.get("rank") is not None else result.get("rank")
    if rank is not None:
        ls["rank"] = str(rank)
    attrs = (("op", where.get("op", "")), ("tensor", where.get("tensor", "")), ("kind", where.get("kind", "")),
             ("verdict", result.get("verdict")), ("preset", result.get("preset")),
             ("pairs", result.get("pairs")), ("differ_bitwise", result.get("differ_bitwise")),
             ("beyond_tolerance", result.get("beyond_tolerance")), ("unmatched", len(result.get("unmatched") or ())),
             ("csv", result.get("csv")), ("bench", result.get("bench")),
             *(fusion_attrs(result.get("fusion_suspect")) if result.get("diverged") else ()),
             # the rank and the unit's write time: the incident kinds tell another rank, a late
             # comparison and a restart apart by them (agent/detectors/dump_incident.py)
             *((("rank", rank),) if rank is not None else ()),
             *((("written", result["written"]),) if result.get("written") is not None else ()))
    metric = DUMP_NONDETERMINISM if result.get("mode") == "rerun" else DUMP_DIVERGENCE
    # a match is a sample too (value 0): the incident kinds count clean steps (dump_incident.py)
    return Sample(make_labels(ls), metric, 1.0 if result.get("diverged") else 0.0, where.get("step", result.get("step")),
                  SourcePos(unit, 0), time.time(), None, attrs)
