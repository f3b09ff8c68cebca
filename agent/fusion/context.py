"""What the graph compiler left behind for a dump: its fusion report and its executed graph.

``scan`` and ``compare`` take them from ``--graph`` / ``--fusion-report``, or find them in the
dump tree (``fusion_result*.json``, ``ge_proto_*_Build.txt``; newest first, a bounded walk), so that
a first bad op made by a fusion pass is named with its passes (``suspect``'s ``graph_pass``).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:   # their parsers are imported where a file is read: most dump trees hold neither
    from .graph import GeGraph
    from .report import FusionReport

REPORT_GLOB = "fusion_result*.json"
GRAPH_GLOB = "ge_proto_*_Build.txt"
GRAPH_GLOBS = (GRAPH_GLOB, "ge_proto_*_Build.json")   # the GE text dump, and its ATC JSON (atc --mode=5)
MAX_WALK = 20_000  # directory entries looked at when searching a dump tree


@dataclass
class FusionContext:
    graph: GeGraph | None = None
    report: FusionReport | None = None
    errors: list[str] = field(default_factory=list)
    # notes that are no error (a search cut at its bound): printed, never a failed scan
    warnings: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.graph is None and self.report is None


def _newest(paths: list[Path]) -> Path | None:
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return -1.0
    return max(paths, key=mtime) if paths else None


class Found(NamedTuple):
    """What :func:`discover` found: the newest report and graph, and why the walk stopped early."""

    report: Path | None
    graph: Path | None
    cut_short: str | None = None   # the walk met its bound before it had seen every folder


def discover(root: Path, limit: int = MAX_WALK) -> Found:
    """The newest fusion report and GE build graph under ``root`` (symlinks not followed).
    Breadth-first, shallow folders first (a job's ``graphs/`` beside a big ``dump/`` is reached),
    names in sorted order; at most ``limit`` entries looked at, and ``cut_short`` says so.
    ``root`` a file: only the files beside it (its folder's own entries, no sibling folder is
    entered): a single dump file's compiler files lie next to it, or are named."""
    reports: list[Path] = []
    graphs: list[Path] = []
    seen = 0
    is_dir = root.is_dir()
    base = root if is_dir else root.parent
    queue: deque[Path] = deque([base])
    while queue:
        folder = queue.popleft()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            seen += 1
            if seen > limit:
                return Found(_newest(reports), _newest(graphs),
                             f"{base}: searched the first {limit} entries for fusion reports and graphs, "
                             f"not the rest (name the files, or their folder, to use them)")
            try:
                entry_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if entry_dir:
                if is_dir:   # a file's search never enters the folders beside it
                    queue.append(Path(e.path))
            elif fnmatch(e.name, REPORT_GLOB):
                reports.append(Path(e.path))
            elif any(fnmatch(e.name, g) for g in GRAPH_GLOBS):
                graphs.append(Path(e.path))
    return Found(_newest(reports), _newest(graphs))


def load_context(graph: str | None = None, reports: list[str] | None = None, root: Path | None = None,
                 ) -> FusionContext:
    """The given files, else those found under ``root``; unreadable ones are listed in ``errors``,
    a search cut at its bound in ``warnings`` (the scan itself is not the worse for it)."""
    ctx = FusionContext()
    found_report = found_graph = None
    if root is not None and (graph is None or not reports):
        found_report, found_graph, cut_short = discover(root)
        if cut_short:
            ctx.warnings.append(cut_short)
    graph_file = graph or (str(found_graph) if found_graph else None)
    report_files = reports or ([str(found_report)] if found_report else [])
    if graph_file:
        from .graph import GraphFormatError, read_graph_file
        try:
            ctx.graph = read_graph_file(graph_file)
        except (GraphFormatError, OSError) as exc:
            ctx.errors.append(f"{graph_file}: {exc}")
    if report_files:
        from .report import FusionReportError, load_reports
        try:
            ctx.report = load_reports(report_files)
        except (FusionReportError, OSError) as exc:
            ctx.errors.append(str(exc))
    return ctx


def context_for(graph: str | None, reports: list[str] | None, roots: list[str | os.PathLike]) -> FusionContext:
    """``compare``: the given files, else the first of the trees (target, then benchmark) that
    holds an executed graph or a fusion report."""
    if graph or reports:
        return load_context(graph, reports, root=Path(roots[0]) if not graph or not reports else None)
    warnings: list[str] = []
    for root in roots:
        ctx = load_context(root=Path(root))
        warnings += ctx.warnings
        if not ctx.empty or ctx.errors:
            ctx.warnings = warnings
            return ctx
    return FusionContext(warnings=warnings)
