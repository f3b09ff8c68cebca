"""Fusion suspicion on the op that went wrong: is the first bad op a fused one, and what to switch off.

Whenever ``scan``, ``compare`` or the daemon names a first bad op (non-finite, overflow, lost
precision), ``suspect`` answers:

* for graph dumps, with the executed GE graph at hand: the op is fused when a pass made it
  (``pass_name``) or it merges several original ops; the suspects are those passes, split into
  GraphFusion and UBFusion by the fusion report, with the ``fusion_switch.cfg`` that turns off
  exactly them;
* for msprobe / PyTorch dumps: the op's API (or module class) is in the catalogue of fused APIs
  (``fused_apis.json``, extendable with ``PRECISION_AGENT_FUSED_APIS``: YAML or JSON), with how to
  run it unfused.

The answer is a ``FusionSuspect`` (``to_json``: ``{"op", "kind", "passes", "original_ops",
"switch_cfg", "advice"}``) or None.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..safeio import FileTooBig, read_regular

if TYPE_CHECKING:
    from .graph import GeGraph
    from .report import FusionReport

CATALOGUE = Path(__file__).with_name("fused_apis.json")
ENV_EXTRA = "PRECISION_AGENT_FUSED_APIS"
MAX_CATALOGUE_BYTES = 1 << 20


class CatalogueError(ValueError):
    pass


# NamedTuples, immutable as the frozen dataclasses they were, and ~5x cheaper to define at import
class FusedApi(NamedTuple):
    api: str
    names: tuple[str, ...]
    fuses: tuple[str, ...]
    unfused: str


class FusionSuspect(NamedTuple):
    op: str
    kind: str                                  # "graph_pass" | "fused_api"
    passes: tuple[str, ...] = ()
    original_ops: tuple[str, ...] = ()
    switch_cfg: dict[str, Any] | None = None
    advice: str = ""
    api: str | None = None
    fuses: tuple[str, ...] = ()
    fused_ops: tuple[str, ...] = ()   # compare across fusion: the fused API calls inside the diverging module

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op, "kind": self.kind, "passes": list(self.passes),
                               "original_ops": list(self.original_ops), "switch_cfg": self.switch_cfg,
                               "advice": self.advice}
        if self.api is not None:
            out["api"], out["fuses"] = self.api, list(self.fuses)
        if self.fused_ops:
            out["fused_ops"] = list(self.fused_ops)
        return out


def _entries(path: Path) -> list[FusedApi]:
    """The entries of a catalogue file: ours is JSON (json is imported anyway; PyYAML's import
    alone was ~5% of a ``compare``), a user's is YAML (which reads JSON too)."""
    try:
        text = read_regular(path, MAX_CATALOGUE_BYTES).decode("utf-8")
    except (OSError, FileTooBig, UnicodeDecodeError) as exc:
        raise CatalogueError(f"{path}: {exc}") from None
    if path == CATALOGUE:
        import json
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise CatalogueError(f"{path}: {exc}") from None
    else:
        import yaml   # here: only for a user's file
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise CatalogueError(f"{path}: {exc}") from None
    items = doc.get("fused_apis") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise CatalogueError(f"{path}: expected a mapping with a list 'fused_apis'")
    out = []
    for i, e in enumerate(items):
        if not (isinstance(e, dict) and isinstance(e.get("api"), str) and isinstance(e.get("names"), list)
                and all(isinstance(n, str) and n for n in e["names"])):
            raise CatalogueError(f"{path}: fused_apis[{i}]: needs 'api' (text) and 'names' (a list of names)")
        out.append(FusedApi(e["api"], tuple(e["names"]), tuple(str(x) for x in e.get("fuses") or ()),
                            str(e.get("unfused") or "")))
    return out


@functools.lru_cache(maxsize=8)
def catalogue(extra: str | None = None) -> tuple[FusedApi, ...]:
    """The shipped catalogue, plus the file ``extra`` (default: ``$PRECISION_AGENT_FUSED_APIS``)."""
    entries = _entries(CATALOGUE)
    if extra:
        entries = _entries(Path(extra)) + entries  # the user's entries first: they may refine ours
    return tuple(entries)


def _default_catalogue() -> tuple[FusedApi, ...]:
    return catalogue(os.environ.get(ENV_EXTRA) or None)


CATALOGUE_ERROR_PATH = "fusion catalogue"   # the ``path`` of its entry in a result's ``errors``


def catalogue_error() -> str | None:
    """Why the catalogue in force (the shipped one plus ``$PRECISION_AGENT_FUSED_APIS``) cannot be
    read, None when it can: ``scan`` and ``compare`` list it in their ``errors`` rather than
    quietly naming no fused API."""
    try:
        _default_catalogue()
    except CatalogueError as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=1024)
def _parts(op: str) -> tuple[str, ...]:
    return tuple(p for p in re.split(r"[.\s/]", op) if p)


def fused_api(op: str, apis: tuple[FusedApi, ...] | None = None) -> FusedApi | None:
    """The catalogue entry whose name is one of the dotted parts of ``op`` (msprobe
    ``NPU.npu_fusion_attention.0.forward``, ``Module.layers.0.FlashSelfAttention.forward.0``)."""
    parts = set(_parts(op))
    for entry in apis if apis is not None else _default_catalogue():
        if parts.intersection(entry.names):
            return entry
    return None


def suspect(op: str | None, graph: GeGraph | None = None, report: FusionReport | None = None,
            apis: tuple[FusedApi, ...] | None = None) -> FusionSuspect | None:
    """Is the first bad op ``op`` a fused one? None when it is not (or no op was named)."""
    if not op:
        return None
    if graph is not None:
        found = graph.find(op)
        g = next((o for o in found if o.fused), None)
        if g is not None:
            cfg = None
            if report is not None and g.passes:
                from .switch import SwitchError, switch_off   # here: tempfile and random only when needed
                try:
                    cfg = switch_off(g.passes, report).to_json()
                except SwitchError:
                    cfg = None
            advice = (f"switch off {', '.join(g.passes)} with the fusion_switch.cfg given, train again and "
                      "compare (or bisect: precision-agent fusion bisect)" if g.passes else
                      "the op merges several original ops: compare it against a fusion-off run's originals")
            return FusionSuspect(op, "graph_pass", g.passes, g.original_ops or (), cfg, advice)
    entry = fused_api(op, apis)
    if entry is None:
        return None
    return FusionSuspect(op, "fused_api", (), (), None, entry.unfused, entry.api, entry.fuses)
