"""Comparing across fusion: a fusion-on run against a fusion-off run, which do not have the same ops.

They are paired at the level both share (docs/fusion.md, "Compare across fusion"):

- **msprobe** dumps at level ``mix`` or ``L0``: ``Module.*`` entries, whose boundaries are the same in
  both runs. A module is keyed by its path, direction and call count, not its class, so
  ``Module.layers.0.attn.SdpaAttention.forward.0`` pairs with ``Module.layers.0.attn.Attention.forward.0``.
  The API entries inside modules are not paired (their call counters shift once one side runs
  other APIs); the first diverging module is named, and the fused APIs the fusion-on run called
  inside it (``construct.json``'s parent links, else execution order) are the suspects.
- **graph** dumps (CANN) with the fusion-on run's executed graph: msaccucmp's relations. An op
  that stands for one original op pairs with it by that name (one-to-one); a fused op's output
  pairs with the original tensor it stands for (``_datadump_origin_name`` /
  ``_datadump_origin_output_index``: many-to-one); the inputs of a fused op are not paired.

A run is "fused" against the other when it holds fused APIs of the catalogue (or graph ops made by
fusion) that the other does not. Entries that exist on one side only because of fusion (the fused
API, the unfused APIs it replaced, the original ops merged into a fused op, ops the compiler
inserted) are reported in ``fused_away``, not as unmatched.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dumps.types import DumpTensor
from ..fusion.suspect import CatalogueError, FusionSuspect, fused_api, suspect
from .pairing import Pairing, Side, pair_key, pair_sides, tensor_label

if TYPE_CHECKING:   # a graph is read (fusion/context.py) only where a tree holds one
    from ..fusion.graph import GeGraph, GraphOp

_MODULE = re.compile(r"^Module\.(?P<path>.+)\.(?P<cls>[^.]+)\.(?P<dir>forward|backward|parameters_grad)"
                     r"(?:\.(?P<n>\d+))?$")
MAX_CONSTRUCT = 64 << 20


@dataclass
class Across:
    """How two runs that differ in fusion are paired, and what only one of them has."""

    level: str                           # "module" | "graph"
    fused_side: str                      # "target" | "bench": the fusion-on run
    graph: GeGraph | None = None
    fused_away: list[dict[str, Any]] = field(default_factory=list)
    not_paired: dict[str, int] = field(default_factory=lambda: {"target": 0, "bench": 0})
    parents: dict[str, str] = field(default_factory=dict)     # fused side: API entry -> its module
    fused_entries: list[tuple[int, str]] = field(default_factory=list)  # fused side: (order, entry)
    modules: list[tuple[int, str]] = field(default_factory=list)        # fused side: (order, Module entry)

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "fused_side": self.fused_side,
                "graph": self.graph.file if self.graph is not None else None,
                "fused_away": len(self.fused_away), "not_paired": self.not_paired,
                "fused_apis": [n for _o, n in self.fused_entries]}


def module_parts(name: str) -> tuple[str, str, str, str] | None:
    """(path, class, direction, count) of an msprobe ``Module.*`` entry."""
    m = _MODULE.match(name)
    return (m["path"], m["cls"], m["dir"], m["n"] or "") if m else None


def _entries(side: Side) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in side.tensors:
        out.setdefault(t.name, t.order)
    return out


def _fused_only(mine: dict[str, int], other: dict[str, int]) -> list[tuple[int, str]]:
    try:
        return sorted((o, n) for n, o in mine.items() if not n.startswith("Module.") and n not in other
                      and fused_api(n) is not None)
    except CatalogueError:
        return []


# ------------------------------------------------------------------------------------ msprobe

def _read_construct(side: Side) -> dict[str, str]:
    """API entry -> parent module, from the ``construct.json`` beside each ``dump.json``."""
    out: dict[str, str] = {}
    for d in sorted({str(Path(t.path).parent if t.path.endswith("dump.json") else Path(t.path).parent.parent)
                     for t in side.tensors}):
        f = Path(d) / "construct.json"
        try:
            if f.is_file() and f.stat().st_size <= MAX_CONSTRUCT:
                doc = json.loads(f.read_text(encoding="utf-8"))
                if isinstance(doc, dict):
                    out.update({k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)})
        except (OSError, ValueError, UnicodeDecodeError):
            continue
    return out


def plan_msprobe(target: Side, bench: Side) -> Across | None:
    """Module-level pairing when one msprobe run calls fused APIs the other does not."""
    if target.layout != "msprobe" or bench.layout != "msprobe":
        return None
    et, eb = _entries(target), _entries(bench)
    ft, fb = _fused_only(et, eb), _fused_only(eb, et)
    if not ft and not fb:
        return None
    if not any(n.startswith("Module.") for n in et) or not any(n.startswith("Module.") for n in eb):
        return None   # level L1: no module to pair on; the fused API shows as unmatched
    fused = "target" if len(ft) >= len(fb) else "bench"
    side, names = (target, et) if fused == "target" else (bench, eb)
    return Across("module", fused, parents=_read_construct(side), fused_entries=ft if fused == "target" else fb,
                  modules=sorted((o, n) for n, o in names.items() if n.startswith("Module.")))


def _module_key(t: DumpTensor, layout: str) -> tuple:
    parts = module_parts(t.name)
    base = pair_key(t, layout)
    return ((parts[0], parts[2], parts[3]) + base[1:]) if parts else base


def _modules_only(side: Side) -> tuple[Side, list[DumpTensor]]:
    mods = [t for t in side.tensors if t.name.startswith("Module.")]
    rest = [t for t in side.tensors if not t.name.startswith("Module.")]
    return Side(side.path, side.layout, mods, side.errors), rest


def pair_modules(target: Side, bench: Side, plan: Across) -> Pairing:
    mt, rest_t = _modules_only(target)
    mb, rest_b = _modules_only(bench)
    pairing = pair_sides(mt, mb, key=_module_key)
    names_t, names_b = {t.name for t in rest_t}, {t.name for t in rest_b}
    for side, rest, other in (("target", rest_t, names_b), ("bench", rest_b, names_t)):
        plan.not_paired[side] = len(rest)
        seen: set[str] = set()
        for t in rest:
            if t.name in other or t.name in seen:
                continue
            seen.add(t.name)
            api = _api_of(t.name)
            why = (f"fused API {api}: the other run has no such call" if api else
                   "API call of one run only (replaced by a fused API in the other, or a shifted call count)")
            plan.fused_away.append({"side": side, "op": t.name, "reason": why})
    return pairing


def _api_of(name: str) -> str | None:
    try:
        e = fused_api(name)
    except CatalogueError:
        return None
    return e.api if e is not None else None


def _magnitude(st: Any) -> float:
    vals = [abs(v) for v in (getattr(st, "max", None), getattr(st, "min", None)) if v is not None]
    return max((v for v in vals if math.isfinite(v)), default=0.0)


def noise_floor(rows: list[Any]) -> int:
    """Across fusion the two runs compute with different kernels, so a tensor that is zero in
    exact arithmetic (the gradient of a key bias: softmax ignores a constant shift) holds rounding
    noise that differs completely between them. Such a tensor is judged against the scale of its
    op: it passes when its largest absolute difference is within the tolerance of the largest
    value among the op's tensors. Returns how many rows this passed."""
    scale: dict[str, float] = {}
    for r in rows:
        st = r.bench_stats or r.bench.stats
        if st is not None:
            scale[r.target.name] = max(scale.get(r.target.name, 0.0), _magnitude(st))
    passed = 0
    for r in rows:
        if r.ok is not False or r.equal or r.tolerance <= 0.0:
            continue
        if r.diff is not None:
            if r.diff.nonfinite_mismatch:
                continue
            d = r.diff.metrics.get("MaxAbsoluteError")
        elif r.target_stats is not None and r.bench_stats is not None:
            ts, bs = r.target_stats, r.bench_stats
            if (ts.nan, ts.pos_inf, ts.neg_inf) != (bs.nan, bs.pos_inf, bs.neg_inf):
                continue
            pairs = [(a, b) for a, b in ((ts.max, bs.max), (ts.min, bs.min), (ts.mean, bs.mean))
                     if a is not None and b is not None]
            d = max((abs(a - b) for a, b in pairs), default=None)
        else:
            continue
        s = scale.get(r.target.name, 0.0)
        if d is not None and math.isfinite(d) and s > 0.0 and d <= r.tolerance * s:
            r.ok = True
            r.fail_reason = "; ".join(x for x in (r.fail_reason, "rounding noise: within the tolerance of its op's "
                                                  "largest value (compared across fusion)") if x)
            passed += 1
    return passed


def settle(first: dict[str, Any] | None, corrupted: dict[str, Any] | None, rows: list[Any],
           ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The module verdict. A module's inputs come from outside it, but a module inside the first
    diverging one is fed by it: its differing input is no corruption. And where msprobe wrote an
    outer module's entry before the modules inside it, the innermost module that lost precision
    is the one named."""
    if first is None:
        return first, corrupted
    fp = module_parts(first["op"])
    if fp is None:
        return first, corrupted
    bad_in = {r.target.name for r in rows if r.ok is False and r.target.io != "output"}
    best, best_path = None, fp[0]
    for r in rows:
        p = module_parts(r.target.name)
        if (r.ok is False and r.target.io == "output" and r.target.name not in bad_in and p is not None
                and p[2] == fp[2] and p[0].startswith(best_path + ".")):
            best, best_path = r, p[0]
    if best is not None:
        first = {**first, "step": best.target.step, "rank": best.target.rank, "op": best.target.name,
                 "tensor": tensor_label(best.target), "row": best.index}
    if corrupted is not None:
        cp = module_parts(corrupted["op"])
        if cp is not None and (cp[0] + ".").startswith(best_path + "."):
            corrupted = None
    return first, corrupted


def _inside(module: str, plan: Across, bench_name: str | None) -> list[str]:
    """The fused APIs the fusion-on run called inside ``module`` (its own name for that module)."""
    names = {module, bench_name} - {None}
    mp = module_parts(module)
    out = []
    for _order, api in plan.fused_entries:
        parent = plan.parents.get(api)
        if parent is not None:
            chain, hops = parent, 0
            while chain and hops < 64:
                if chain in names or (mp and (p := module_parts(chain)) and (p[0], p[2], p[3]) == (mp[0], mp[2], mp[3])):
                    out.append(api)
                    break
                chain, hops = plan.parents.get(chain, ""), hops + 1
    return out


def _before(module: str, plan: Across) -> list[str]:
    """No construct.json: the fused API calls between the module's entry and the entry of the
    module before it that is not inside it (msprobe writes a module's entry when it returns)."""
    mp = module_parts(module)
    at = next((o for o, n in plan.modules if n == module), None)
    if mp is None or at is None:
        return []
    start = max((o for o, n in plan.modules if o < at and not (module_parts(n) or ("",))[0].startswith(mp[0] + ".")),
                default=-1)
    return [n for o, n in plan.fused_entries if start < o < at]


def module_suspect(first: dict[str, Any] | None, target_op: str | None, bench_op: str | None, plan: Across,
                   ) -> FusionSuspect | None:
    """The fused APIs inside the first diverging module, as a ``fused_api`` suspect."""
    if first is None:
        return None
    fused_name = (target_op if plan.fused_side == "target" else bench_op) or first["op"]
    inside = _inside(fused_name, plan, None) if plan.parents else _before(fused_name, plan)
    if not inside:
        try:
            return suspect(first["op"])
        except CatalogueError:
            return None
    entry = fused_api(inside[0])
    assert entry is not None
    advice = (f"{first['op']} is the first module that diverges between the fusion-on and the fusion-off "
              f"run, and inside it the fusion-on run calls {', '.join(inside)}: {entry.unfused}")
    return FusionSuspect(first["op"], "fused_api", (), (), None, advice, entry.api, entry.fuses, tuple(inside))


# -------------------------------------------------------------------------------------- graph

def plan_graph(target: Side, bench: Side, graph: GeGraph | None) -> Across | None:
    """msaccucmp-style pairing when ``graph`` is the executed graph of one side and that side has
    fused ops (or ops renamed from their original) the other side does not."""
    if graph is None or "msprobe" in (target.layout, bench.layout):
        return None
    by_name = {o.name: o for o in graph.ops}
    names = {"target": {t.name for t in target.tensors}, "bench": {t.name for t in bench.tensors}}
    score = {}
    for side, other in (("target", "bench"), ("bench", "target")):
        score[side] = sum(1 for n in names[side] - names[other]
                          if n in by_name and by_name[n].original_ops is not None
                          and tuple(by_name[n].original_ops) != (n,))
    if not max(score.values()):
        return None
    return Across("graph", "target" if score["target"] >= score["bench"] else "bench", graph=graph)


def _graph_key(op: GraphOp | None, t: DumpTensor, layout: str) -> tuple | None:
    """The fusion-off run's key for a fusion-on tensor (None: not comparable across fusion)."""
    if op is None or op.original_ops is None:
        return pair_key(t, layout)
    orig = op.original_ops
    if t.io == "output":
        o = next((x for x in op.outputs if x.index == t.index), None)
        if o is not None and o.origin_name:
            return (o.origin_name, "output", o.origin_output_index if o.origin_output_index is not None else t.index)
        return (orig[0], "output", t.index) if len(orig) == 1 else None
    return (orig[0], t.io, t.index) if len(orig) == 1 else None


def pair_graph(target: Side, bench: Side, plan: Across) -> Pairing:
    assert plan.graph is not None
    by_name = {o.name: o for o in plan.graph.ops}
    skipped: list[DumpTensor] = []

    def fused_key(t: DumpTensor, layout: str) -> tuple:
        k = _graph_key(by_name.get(t.name), t, layout)
        if k is None:
            skipped.append(t)
            return ("\0not-paired", t.name, t.io, t.index)
        return k

    kt, kb = (fused_key, pair_key) if plan.fused_side == "target" else (pair_key, fused_key)
    pairing = pair_sides(target, bench, key=kt, bench_key=kb)
    merged = {n: o.name for o in plan.graph.ops if o.fused for n in (o.original_ops or ())}
    kept, seen = [], set()
    skip_ids = {id(t) for t in skipped}
    for u, (side, t) in zip(pairing.unmatched, pairing.unmatched_tensors):
        why = None
        if side == plan.fused_side:
            op = by_name.get(t.name)
            if op is not None and op.original_ops == ():
                why = "inserted by the graph compiler: no original op"
            elif id(t) in skip_ids:
                why = f"input of fused op {t.name}: not compared across fusion (its output is)"
        elif t.name in merged:
            why = f"merged into fused op {merged[t.name]}"
        if why is None:
            kept.append((u, (side, t)))
        elif (side, t.name) not in seen:
            seen.add((side, t.name))
            plan.fused_away.append({"side": side, "op": t.name, "reason": why})
    pairing.unmatched = [u for u, _ in kept]
    pairing.unmatched_tensors = [x for _, x in kept]
    return pairing


def plan(target: Side, bench: Side, graph: GeGraph | None = None) -> Across | None:
    return plan_msprobe(target, bench) or plan_graph(target, bench, graph)


def pair_across(target: Side, bench: Side, p: Across) -> Pairing:
    return pair_modules(target, bench, p) if p.level == "module" else pair_graph(target, bench, p)
