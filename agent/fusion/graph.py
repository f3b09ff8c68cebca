"""The executed (post-fusion) GE graph: which fusion passes made each op, which original framework
ops it stands for, and which original tensor each of its outputs carries (reference §2.7).

Two encodings of the same ``ge.proto.ModelDef`` are read:

* the ATC JSON (``atc --mode=1|5 --json=...``): ``{"graph": [{"op": [{"name", "type", "attr":
  [{"key", "value": {"s"|"i"|"b"|"f"|"list": {"s": [...]}}}], "output_desc": [{"attr": [...]}]}]}]}``;
* the protobuf text dump ``ge_proto_*_Build.txt`` (read by :mod:`.prototext`): ``graph { op { name:
  "..." attr { key: "pass_name" value { list { s: "..." } } } output_desc { attr { ... } } } }``.

Attributes used: op ``pass_name`` (fusion passes), ``_datadump_original_op_names`` (original ops;
an empty list marks a compiler-inserted op), output ``_datadump_origin_name`` and
``_datadump_origin_output_index``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Union

from ..safeio import FileTooBig, read_regular
from . import FusionFileError, prototext
from .prototext import Message

MAX_GRAPH_BYTES = 512 << 20  # a Build graph without weights (DUMP_GE_GRAPH=2) is far smaller
MAX_STRING = 64 << 10        # longer strings of a GE text graph (weights) are skipped, not decoded
PASS_NAME = "pass_name"
ORIGINAL_OPS = "_datadump_original_op_names"
ORIGIN_NAME = "_datadump_origin_name"
ORIGIN_INDEX = "_datadump_origin_output_index"

AttrValue = Union[str, int, float, bool, tuple[Union[str, int, float, bool], ...], None]


class GraphFormatError(FusionFileError):
    """A graph file that cannot be read."""


@dataclass(frozen=True)
class OutputOrigin:
    """Output ``index`` of an op stands for output ``origin_output_index`` of original op ``origin_name``."""
    index: int
    origin_name: str | None
    origin_output_index: int | None


@dataclass(frozen=True)
class GraphOp:
    name: str
    type: str
    graph: str
    passes: tuple[str, ...]
    original_ops: tuple[str, ...] | None   # None: attribute absent; (): a compiler-inserted op
    outputs: tuple[OutputOrigin, ...]

    @property
    def fused(self) -> bool:
        """Made by a fusion pass, or merging several original ops."""
        return bool(self.passes) or len(self.original_ops or ()) > 1

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "type": self.type, "graph": self.graph, "passes": list(self.passes),
                "original_ops": None if self.original_ops is None else list(self.original_ops),
                "fused": self.fused,
                "outputs": [{"index": o.index, "origin_name": o.origin_name,
                             "origin_output_index": o.origin_output_index} for o in self.outputs]}


@dataclass
class GeGraph:
    file: str
    format: str                 # "atc_json" | "ge_text"
    model: str
    graphs: list[str]
    ops: list[GraphOp] = field(default_factory=list)

    def op(self, name: str) -> GraphOp | None:
        return next((o for o in self.ops if o.name == name), None)

    def find(self, name: str) -> list[GraphOp]:
        """Ops named ``name``, or else the ops that merged an original op of that name."""
        exact = [o for o in self.ops if o.name == name]
        return exact or [o for o in self.ops if name in (o.original_ops or ())]

    def to_json(self) -> dict[str, object]:
        return {"file": self.file, "format": self.format, "model": self.model, "graphs": self.graphs,
                "ops": len(self.ops), "fused_ops": sum(1 for o in self.ops if o.fused),
                "op_list": [o.to_json() for o in self.ops]}


# --- attribute values -------------------------------------------------------------------------

def _json_value(v: object) -> AttrValue:
    """An AttrDef value of the ATC JSON: {"s": ...} | {"i": ...} | {"list": {"s": [...]}} | null."""
    if not isinstance(v, dict):
        return None
    for k in ("s", "i", "f", "b"):
        if k in v and isinstance(v[k], (str, int, float, bool)):
            return v[k]
    lst = v.get("list")
    if isinstance(lst, dict):
        for k in ("s", "i", "f", "b"):
            items = lst.get(k)
            if isinstance(items, list):
                return tuple(x for x in items if isinstance(x, (str, int, float, bool)))
        return ()
    return None


def _text_value(v: Message) -> AttrValue:
    for k in ("s", "i", "f", "b"):
        x = v.get(k)
        if x is not None and not isinstance(x, Message):
            return x
    lst = v.get("list")
    if isinstance(lst, Message):
        for k in ("s", "i", "f", "b"):
            items = [x for x in lst.all(k) if not isinstance(x, Message)]
            if items:
                return tuple(items)
        return ()
    return None


def _json_attrs(raw: object) -> dict[str, AttrValue]:
    """``attr`` as a list of {"key", "value"} (ATC) or as a map (protobuf JSON)."""
    if isinstance(raw, dict):
        return {str(k): _json_value(v) for k, v in raw.items()}
    out: dict[str, AttrValue] = {}
    for entry in raw if isinstance(raw, list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("key"), str):
            out[entry["key"]] = _json_value(entry.get("value"))
    return out


def _text_attrs(msg: Message) -> dict[str, AttrValue]:
    out: dict[str, AttrValue] = {}
    for entry in msg.messages("attr"):
        key, value = entry.get("key"), entry.get("value")
        if isinstance(key, str):
            out[key] = _text_value(value) if isinstance(value, Message) else None
    return out


def _strings(v: AttrValue) -> tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, tuple):
        return tuple(str(x) for x in v)
    return (str(v),) if v != "" else ()


def _op(name: object, type_: object, graph: str, attrs: dict[str, AttrValue],
        outputs: list[dict[str, AttrValue]]) -> GraphOp:
    origins = []
    for i, oa in enumerate(outputs):
        on, oi = oa.get(ORIGIN_NAME), oa.get(ORIGIN_INDEX)
        origins.append(OutputOrigin(i, on if isinstance(on, str) else None,
                                    oi if isinstance(oi, int) and not isinstance(oi, bool) else None))
    return GraphOp(str(name or ""), str(type_ or ""), graph, _strings(attrs.get(PASS_NAME)) or (),
                   _strings(attrs.get(ORIGINAL_OPS)), tuple(origins))


# --- the two encodings ----------------------------------------------------------------------------

def parse_atc_json(doc: object, file: str) -> GeGraph:
    if not isinstance(doc, dict) or not isinstance(doc.get("graph"), list):
        raise GraphFormatError(file, "not an ATC graph JSON (no 'graph' list)")
    g = GeGraph(file, "atc_json", str(doc.get("name") or ""), [])
    for graph in doc["graph"]:
        if not isinstance(graph, dict):
            continue
        gname = str(graph.get("name") or "")
        g.graphs.append(gname)
        for op in graph.get("op") or ():
            if not isinstance(op, dict):
                continue
            outs = [_json_attrs(d.get("attr")) for d in op.get("output_desc") or () if isinstance(d, dict)]
            g.ops.append(_op(op.get("name"), op.get("type"), gname, _json_attrs(op.get("attr")), outs))
    return g


def parse_ge_text(text: str, file: str, max_depth: int = prototext.MAX_DEPTH) -> GeGraph:
    """A ``ge_proto_*.txt`` dump (ModelDef with graphs, or a bare GraphDef). Ops are converted as
    they close and not kept as messages, so a big graph costs its GraphOps, not its text tree."""
    g = GeGraph(file, "ge_text", "", [])
    pending: list[GraphOp] = []

    def on_close(path: list[str], msg: Message) -> bool:
        if path[-1] == "op" and len(path) <= 2 and (len(path) == 1 or path[0] == "graph"):
            outs = [_text_attrs(d) for d in msg.messages("output_desc")]
            pending.append(_op(msg.get("name"), msg.get("type"), "", _text_attrs(msg), outs))
            return True
        if path == ["graph"]:
            gname = msg.get("name")
            gname = gname if isinstance(gname, str) else ""
            g.graphs.append(gname)
            g.ops.extend(GraphOp(o.name, o.type, gname, o.passes, o.original_ops, o.outputs) for o in pending)
            pending.clear()
        return False

    try:
        root = prototext.parse(text, max_depth=max_depth, on_close=on_close, max_string=MAX_STRING)
    except prototext.ProtoTextError as exc:
        raise GraphFormatError(file, f"protobuf text: {exc}") from None
    if pending:  # a bare GraphDef: ops at the top level
        gname = root.get("name")
        g.graphs.append(gname if isinstance(gname, str) else "")
        g.ops.extend(GraphOp(o.name, o.type, g.graphs[-1], o.passes, o.original_ops, o.outputs) for o in pending)
    elif root.get("name") is not None:
        g.model = str(root.get("name"))
    if not g.graphs:
        raise GraphFormatError(file, "no graph in this protobuf text (no 'graph { op { ... } }' block)")
    return g


def read_graph_file(path: str | os.PathLike[str], max_bytes: int = MAX_GRAPH_BYTES) -> GeGraph:
    """Read an ATC JSON graph or a GE text dump (told apart by the first character)."""
    file = str(path)
    try:
        raw = read_regular(path, max_bytes)   # a FIFO is refused at once, never waited on
    except FileTooBig as exc:
        raise GraphFormatError(file, str(exc)) from None
    except OSError as exc:
        raise GraphFormatError(file, exc.strerror or str(exc)) from None
    text = raw.decode("utf-8", "surrogateescape").lstrip("\ufeff")
    if not text.strip():
        raise GraphFormatError(file, "empty file")
    if text.lstrip().startswith(("{", "[")):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GraphFormatError(file, f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        except RecursionError:
            raise GraphFormatError(file, "JSON nested too deeply") from None
        return parse_atc_json(doc, file)
    return parse_ge_text(text, file)


def format_graph(g: GeGraph, ops: list[GraphOp] | None = None) -> str:
    """A readable table: op, type, passes, original ops (fused ops marked)."""
    shown = g.ops if ops is None else ops
    lines = [f"{g.file}: {g.format}, model {g.model or '-'}, {len(g.graphs)} graph(s), {len(g.ops)} op(s), "
             f"{sum(1 for o in g.ops if o.fused)} fused"]
    if not shown:
        return "\n".join(lines)
    wn = max(len("op"), *(len(o.name) for o in shown))
    wt = max(len("type"), *(len(o.type) for o in shown))
    lines.append(f"  {'op':<{wn}}  {'type':<{wt}}  passes / original ops")
    for o in shown:
        passes = ",".join(o.passes) or "-"
        orig = "(none: inserted)" if o.original_ops == () else ",".join(o.original_ops or ()) or "-"
        lines.append(f"  {o.name:<{wn}}  {o.type:<{wt}}  {'*' if o.fused else ' '} {passes} / {orig}")
        for out in o.outputs:
            if out.origin_name is not None:
                lines.append(f"  {'':<{wn}}  {'':<{wt}}    output {out.index} = {out.origin_name}"
                             f":{out.origin_output_index if out.origin_output_index is not None else '?'}")
    return "\n".join(lines)
