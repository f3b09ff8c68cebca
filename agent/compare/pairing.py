"""Pairing: which target tensor is compared with which benchmark tensor.

Both sides are read by :func:`precision_agent.dumps.discovery.discover` (one reader per layout, shared
with ``scan``). Tensors are first grouped by (step, rank), then paired inside a group by a key
that does not depend on when or where the run happened:

- msprobe: the ``dump.json`` entry key, the io kind and msprobe's argument label
  (``Functional.linear.5.forward``, ``input``, ``1``); kwargs by name, params by name;
- CANN and MindSpore: op name, ``input``/``output``, slot (timestamps and task ids differ run to
  run, so they are not part of the key);
- TF benchmark ``.npy`` files ``{op}.{output_index}.{timestamp}.npy``: op name, ``output``, index,
  so a CANN target pairs with a TF benchmark by op name as msaccucmp does;
- any other ``.npy``/``.npz`` tree: the path relative to the tree's root.

A key seen several times in one group (an op run twice in a step) pairs by occurrence: the n-th
target occurrence with the n-th benchmark one. Groups: equal (step, rank) pair; leftovers pair by
step when each side has one rank for that step (msprobe ``proc<PID>`` vs ``rank0``); when each
side has a single group left they pair whatever their numbers (``step3`` against ``step7``).
Everything left over is returned as unmatched, never dropped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..dumps.discovery import discover
from ..dumps.types import DumpTensor

TF_NPY = re.compile(r"(?P<op>.+)\.(?P<index>\d+)\.(?P<ts>\d{10,})\.npy")
Group = tuple[int | None, int | None]
KeyFn = Callable[[DumpTensor, str], tuple]


@dataclass(slots=True)
class Side:
    """One side of a comparison as read from disk."""

    path: str
    layout: str
    tensors: list[DumpTensor]
    errors: list[tuple[str, str]]


@dataclass(slots=True)
class Pair:
    target: DumpTensor
    bench: DumpTensor
    step: int | None            # the target's step and rank (the bench's may differ, see module doc)
    rank: int | None


@dataclass(slots=True)
class Pairing:
    pairs: list[Pair] = field(default_factory=list)
    unmatched: list[dict[str, Any]] = field(default_factory=list)
    unmatched_tensors: list[tuple[str, DumpTensor]] = field(default_factory=list)  # same order

    def leave(self, side: str, t: DumpTensor, reason: str) -> None:
        self.unmatched.append({"side": side, "step": t.step, "rank": t.rank, "op": t.name,
                               "tensor": tensor_label(t), "path": t.path, "reason": reason})
        self.unmatched_tensors.append((side, t))


def read_side(path: str | os.PathLike) -> Side:
    """Discover a dump tree; a missing path raises FileNotFoundError (a usage error upstream)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    tensors, errors, layout = discover(p)
    return Side(str(p), layout, tensors, errors)


def tensor_label(t: DumpTensor) -> str:
    """How reports name a tensor inside its op: ``input_args[2]``, ``output[0]``, ``input[1]``."""
    slot, arg = t.extra.get("slot"), t.extra.get("arg")
    if slot is not None and arg is not None:
        return f"{slot}[{arg}]"
    return f"{t.io or 'output'}[{t.index}]"


def pair_key(t: DumpTensor, layout: str) -> tuple:
    """The run-independent identity of a tensor within its (step, rank) group."""
    layout = t.extra.get("layout", layout)   # a "mixed" tree: each tensor says its own
    if layout == "msprobe":
        return (t.name, t.io, str(t.extra.get("arg", t.index)))
    if layout == "npy":
        m = TF_NPY.fullmatch(os.path.basename(t.name))
        if m and "member" not in t.extra:
            return (m.group("op"), "output", int(m.group("index")))
        return (t.name.replace(os.sep, "/"),)
    return (t.name, t.io, t.index)


def _groups(side: Side) -> dict[Group, list[DumpTensor]]:
    out: dict[Group, list[DumpTensor]] = {}
    for t in side.tensors:
        out.setdefault((t.step, t.rank), []).append(t)
    return out


def _sort_key(g: Group) -> tuple:
    return (g[0] is not None, g[0] or 0, g[1] is not None, g[1] or 0)


def filter_side(side: Side, step: int | None, rank: int | None) -> None:
    """Keep one step and/or rank; a side without step (rank) numbers at all is kept whole."""
    if step is not None and any(t.step is not None for t in side.tensors):
        side.tensors = [t for t in side.tensors if t.step == step]
    if rank is not None and any(t.rank is not None for t in side.tensors):
        side.tensors = [t for t in side.tensors if t.rank == rank]


def match_groups(target: dict[Group, Any], bench: dict[Group, Any]) -> list[tuple[Group, Group]]:
    """(target group, bench group) pairs, by the rules in the module docstring."""
    out = [(g, g) for g in sorted(set(target) & set(bench), key=_sort_key)]
    left_t = [g for g in target if g not in bench]
    left_b = [g for g in bench if g not in target]
    by_step_t: dict[Any, list[Group]] = {}
    by_step_b: dict[Any, list[Group]] = {}
    for g in left_t:
        by_step_t.setdefault(g[0], []).append(g)
    for g in left_b:
        by_step_b.setdefault(g[0], []).append(g)
    for s in sorted(set(by_step_t) & set(by_step_b), key=lambda s: (s is not None, s or 0)):
        if len(by_step_t[s]) == 1 and len(by_step_b[s]) == 1:
            out.append((by_step_t[s][0], by_step_b[s][0]))
            left_t.remove(by_step_t[s][0])
            left_b.remove(by_step_b[s][0])
    if len(left_t) == 1 and len(left_b) == 1:
        out.append((left_t[0], left_b[0]))
    return sorted(out, key=lambda gg: _sort_key(gg[0]))


def pair_sides(target: Side, bench: Side, key: KeyFn | None = None, bench_key: KeyFn | None = None) -> Pairing:
    """Pair every target tensor with its benchmark tensor; list the rest as unmatched. ``key`` /
    ``bench_key``: another pairing key than :func:`pair_key` (comparing across fusion, across.py)."""
    key = key or pair_key
    bench_key = bench_key or key
    result = Pairing()
    tg, bg = _groups(target), _groups(bench)
    matched = match_groups(tg, bg)
    for gt, gb in matched:
        keyed: dict[tuple, list[DumpTensor]] = {}
        for t in bg[gb]:
            keyed.setdefault(bench_key(t, bench.layout), []).append(t)
        taken: dict[tuple, int] = {}
        for t in sorted(tg[gt], key=lambda x: x.order):
            k = key(t, target.layout)
            n = taken.get(k, 0)
            cands = keyed.get(k, [])
            if n < len(cands):
                result.pairs.append(Pair(t, cands[n], t.step, t.rank))
                taken[k] = n + 1
            else:
                result.leave("target", t, "no benchmark tensor with this name")
        for k, cands in keyed.items():
            for t in cands[taken.get(k, 0):]:
                result.leave("bench", t, "no target tensor with this name")
    done_t = {g for g, _ in matched}
    done_b = {g for _, g in matched}
    for g in sorted(set(tg) - done_t, key=_sort_key):
        for t in tg[g]:
            result.leave("target", t, "no benchmark step/rank to pair with")
    for g in sorted(set(bg) - done_b, key=_sort_key):
        for t in bg[g]:
            result.leave("bench", t, "no target step/rank to pair with")
    return result
