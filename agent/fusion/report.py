"""The graph compiler's fusion report, ``fusion_result.json``: which fusion passes matched and which
were applied, per graph (reference ascend-formats.md §2.8).

Every shape seen on disk is read:

1. one flat object ``{"graph_fusion": {...}, "ub_fusion": {...}, "session_and_graph_id": "0_0"}``;
2. a JSON array of such objects, one per graph;
3. an object keyed by ``"session_and_graph_id_<s>_<g>"``, each value holding ``graph_fusion`` /
   ``ub_fusion``;
4. several objects (of any shape above) written back to back with no separator (older CANN).

Per pass the counts ``match_times`` and ``effect_times`` are strings ("70"); UB passes may carry
``repository_hit_times`` too. A pass is *effective* when ``effect_times > 0`` in some graph: the
passes precision_tool's fusion check lists. *Matched only*: matched somewhere, never applied.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..safeio import FileTooBig, read_regular
from . import FusionFileError

MAX_REPORT_BYTES = 64 << 20  # a real report is a few KB; refuse anything that could exhaust memory
GRAPH_FUSION, UB_FUSION = "graph_fusion", "ub_fusion"
_KEYED = re.compile(r"session_and_graph_id_(\d+)_(\d+)\Z")
_MAX_COUNT_DIGITS = 18


class FusionReportError(FusionFileError):
    """A fusion report that cannot be read."""


@dataclass(frozen=True)
class PassCount:
    match_times: int
    effect_times: int
    repository_hit_times: int | None = None

    def __add__(self, other: PassCount) -> PassCount:
        hits = (None if self.repository_hit_times is None and other.repository_hit_times is None
                else (self.repository_hit_times or 0) + (other.repository_hit_times or 0))
        return PassCount(self.match_times + other.match_times, self.effect_times + other.effect_times, hits)

    def to_json(self) -> dict[str, int]:
        out = {"match_times": self.match_times, "effect_times": self.effect_times}
        if self.repository_hit_times is not None:
            out["repository_hit_times"] = self.repository_hit_times
        return out


@dataclass(frozen=True)
class GraphPasses:
    """The passes of one compiled graph."""
    graph_id: str                                  # "0_0" (session_graph), or "#<n>" when the file names none
    graph_fusion: dict[str, PassCount]
    ub_fusion: dict[str, PassCount]


@dataclass
class FusionReport:
    """One or more fusion reports merged: per graph, and the union over graphs (counts summed)."""
    files: list[str]
    graphs: list[GraphPasses]
    graph_fusion: dict[str, PassCount] = field(default_factory=dict)
    ub_fusion: dict[str, PassCount] = field(default_factory=dict)

    @property
    def effective(self) -> list[str]:
        """Passes applied at least once (effect_times > 0), sorted; a name in both tables once."""
        return sorted({p for table in (self.graph_fusion, self.ub_fusion)
                       for p, c in table.items() if c.effect_times > 0})

    @property
    def matched_only(self) -> list[str]:
        """Passes that matched somewhere but were never applied."""
        return sorted({p for table in (self.graph_fusion, self.ub_fusion)
                       for p, c in table.items() if c.match_times > 0 and c.effect_times == 0}
                      - set(self.effective))

    def kinds(self, name: str) -> tuple[str, ...]:
        """Where a pass lives: ("GraphFusion",), ("UBFusion",), both, or () when unknown."""
        return tuple(k for k, table in (("GraphFusion", self.graph_fusion), ("UBFusion", self.ub_fusion))
                     if name in table)

    def per_graph_keys(self) -> list[str]:
        """Unique keys for ``per_graph``: the graph id (``load_reports`` prefixes it with the file
        name when several files are read), suffixed ``#n`` when an id repeats."""
        seen: dict[str, int] = {}
        keys = []
        for g in self.graphs:
            key = g.graph_id
            seen[key] = seen.get(key, 0) + 1
            keys.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
        return keys


def _count(file: str, where: str, value: object) -> int:
    if isinstance(value, bool):
        raise FusionReportError(file, f"{where}: not a count: {value!r}")
    if isinstance(value, int):
        n = value
    elif (isinstance(value, str) and value.strip().isascii() and value.strip().isdigit()   # not "²"
          and len(value.strip()) <= _MAX_COUNT_DIGITS):
        n = int(value.strip())
    else:
        raise FusionReportError(file, f"{where}: not a count: {str(value)[:40]!r}")
    if n < 0:
        raise FusionReportError(file, f"{where}: negative count {n}")
    return n


def _table(file: str, where: str, raw: object) -> dict[str, PassCount]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise FusionReportError(file, f"{where}: expected an object of passes, got {type(raw).__name__}")
    out: dict[str, PassCount] = {}
    for name, counts in raw.items():
        at = f"{where}.{name}"
        if not isinstance(counts, dict):
            raise FusionReportError(file, f"{at}: expected {{'match_times', 'effect_times'}}, "
                                          f"got {type(counts).__name__}")
        for key in ("match_times", "effect_times"):
            if key not in counts:
                raise FusionReportError(file, f"{at}: no {key}")
        hits = counts.get("repository_hit_times")
        out[name] = PassCount(_count(file, f"{at}.match_times", counts["match_times"]),
                              _count(file, f"{at}.effect_times", counts["effect_times"]),
                              None if hits is None else _count(file, f"{at}.repository_hit_times", hits))
    return out


def _flat(file: str, obj: dict[str, object], graph_id: str | None, ordinal: int) -> GraphPasses:
    gid = graph_id or obj.get("session_and_graph_id") or obj.get("graphId")
    gid = str(gid) if gid is not None else f"#{ordinal}"
    return GraphPasses(gid, _table(file, f"graph {gid}: {GRAPH_FUSION}", obj.get(GRAPH_FUSION)),
                       _table(file, f"graph {gid}: {UB_FUSION}", obj.get(UB_FUSION)))


def _is_flat(obj: dict[str, object]) -> bool:
    return any(k in obj for k in (GRAPH_FUSION, UB_FUSION, "session_and_graph_id", "graphId"))


def _graphs_of(file: str, doc: object, index: int, out: list[GraphPasses]) -> None:
    where = f"document {index + 1}"
    if isinstance(doc, list):
        for i, item in enumerate(doc):
            if not isinstance(item, dict) or not (_is_flat(item) or not item):
                raise FusionReportError(file, f"{where}, item {i + 1}: not a graph's fusion object")
            if item:
                out.append(_flat(file, item, None, len(out) + 1))
        return
    if not isinstance(doc, dict):
        raise FusionReportError(file, f"{where}: expected an object or an array, got {type(doc).__name__}")
    if _is_flat(doc):
        out.append(_flat(file, doc, None, len(out) + 1))
        return
    keyed = [(m, v) for k, v in doc.items() if (m := _KEYED.match(k))]
    if not keyed and doc:
        raise FusionReportError(file, f"{where}: not a fusion report (no graph_fusion, ub_fusion or "
                                      f"session_and_graph_id_<s>_<g> key; keys: {', '.join(list(doc)[:5])})")
    for m, value in keyed:
        gid = f"{m.group(1)}_{m.group(2)}"
        if not isinstance(value, dict):
            raise FusionReportError(file, f"{m.group(0)}: expected an object, got {type(value).__name__}")
        out.append(_flat(file, value, gid, len(out) + 1))


def _documents(file: str, text: str) -> list[object]:
    """All JSON values in ``text``, back to back or alone (json.JSONDecoder.raw_decode in a loop)."""
    decoder = json.JSONDecoder()
    docs: list[object] = []
    pos, end = 0, len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n":
            pos += 1
        if pos >= end:
            break
        try:
            doc, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):
                raise FusionReportError(file, f"truncated: the JSON ends early ({exc.msg} "
                                              f"at line {exc.lineno} column {exc.colno})") from None
            raise FusionReportError(file, f"not JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
        except RecursionError:
            raise FusionReportError(file, "JSON nested too deeply") from None
        docs.append(doc)
    if not docs:
        raise FusionReportError(file, "empty file")
    return docs


def parse_report_text(text: str, file: str = "<text>") -> list[GraphPasses]:
    """The graphs of one report's text (every shape of §2.8)."""
    if text.startswith("\ufeff"):
        text = text[1:]
    graphs: list[GraphPasses] = []
    for i, doc in enumerate(_documents(file, text)):
        _graphs_of(file, doc, i, graphs)
    return graphs


def read_report_file(path: str | os.PathLike[str], max_bytes: int = MAX_REPORT_BYTES) -> list[GraphPasses]:
    """Read one ``fusion_result.json``; FusionReportError when it is missing, too big or malformed."""
    file = str(path)
    try:
        raw = read_regular(path, max_bytes)   # a FIFO is refused at once, never waited on
    except FileTooBig as exc:
        raise FusionReportError(file, f"{exc}; not a fusion report") from None
    except OSError as exc:
        raise FusionReportError(file, exc.strerror or str(exc)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FusionReportError(file, f"not UTF-8 text (byte {exc.start})") from None
    return parse_report_text(text, file)


def merge(files: list[str], graphs: list[GraphPasses]) -> FusionReport:
    """The union over graphs: per pass, counts summed over every graph that lists it."""
    report = FusionReport(files=files, graphs=graphs)
    for g in graphs:
        for mine, theirs in ((report.graph_fusion, g.graph_fusion), (report.ub_fusion, g.ub_fusion)):
            for name, count in theirs.items():
                mine[name] = mine[name] + count if name in mine else count
    return report


def load_reports(paths: list[str | os.PathLike[str]], max_bytes: int = MAX_REPORT_BYTES) -> FusionReport:
    """Read and merge several reports; with more than one file, graph ids are prefixed by the file name."""
    graphs: list[GraphPasses] = []
    for p in paths:
        these = read_report_file(p, max_bytes)
        if len(paths) > 1:
            these = [GraphPasses(f"{Path(p).name}:{g.graph_id}", g.graph_fusion, g.ub_fusion) for g in these]
        graphs.extend(these)
    return merge([str(p) for p in paths], graphs)


def report_json(report: FusionReport) -> dict[str, object]:
    """The ``fusion passes --json`` object."""
    def table(t: dict[str, PassCount]) -> dict[str, dict[str, int]]:
        return {name: t[name].to_json() for name in sorted(t)}
    return {
        "files": report.files,
        "graphs": len(report.graphs),
        "graph_fusion": table(report.graph_fusion),
        "ub_fusion": table(report.ub_fusion),
        "effective": report.effective,
        "matched_only": report.matched_only,
        "per_graph": {key: {"graph_fusion": table(g.graph_fusion), "ub_fusion": table(g.ub_fusion)}
                      for key, g in zip(report.per_graph_keys(), report.graphs)},
    }


def format_report(report: FusionReport) -> str:
    """Readable tables, as precision_tool prints them: Graph Fusion and UB Fusion, effective passes
    first, then the matched-only ones."""
    lines = [f"{len(report.graphs)} graph(s) in {', '.join(report.files)}"]
    for title, table in (("Graph Fusion", report.graph_fusion), ("UB Fusion", report.ub_fusion)):
        lines.append("")
        lines.append(f"{title}: {sum(1 for c in table.values() if c.effect_times > 0)} effective, "
                     f"{sum(1 for c in table.values() if c.effect_times == 0 and c.match_times > 0)} matched only")
        if not table:
            continue
        width = max(len("pass"), *(len(n) for n in table))
        lines.append(f"  {'pass':<{width}}  {'effect':>8}  {'match':>8}")
        order = sorted(table, key=lambda n: (table[n].effect_times == 0, n))
        for name in order:
            c = table[name]
            mark = "" if c.effect_times > 0 else "  (matched only)"
            lines.append(f"  {name:<{width}}  {c.effect_times:>8}  {c.match_times:>8}{mark}")
    lines.append("")
    lines.append(f"effective: {len(report.effective)} pass(es)")
    return "\n".join(lines)
