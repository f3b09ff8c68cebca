"""The daemon's fusion files: the graph compiler's report and executed graph, picked up where the job
writes them, the latest per job (docs/fusion.md, "In the daemon").

A dump watch's places are its own tree (the job's dump directories) and the files or folders its
``fusion_files`` option names (typically the job's working directory, where ``fusion_result.json``
is written, and ``DUMP_GRAPH_PATH``). Each time the watch's dumps are scanned or compared, the newest
fusion report and the newest executed graph of those places are taken (bounded walks, see
context.py); they are parsed again only when one of them changed, so a job that compiles again
(a new graph, a new report) is followed and an unchanged one costs two ``stat`` calls a place.

The scan thread then asks the graph about the first bad op (``annotate``): when a pass made it,
``fusion_suspect`` names the passes and the ``fusion_switch.cfg`` that turns off exactly them, the
sample carries them, and ``FusionSuspected`` fires. A file that cannot be read is reported once
per version of the file (``errors``, then the scan's ``fusion`` error), never again until it changes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Callable

from ..health import Cancelled
from ..fusion.context import REPORT_GLOB, FusionContext, discover, load_context

FileSig = tuple[str, int, int] | None
# graphs the scan thread parses (several MB/s): a bigger one would hold the worker for minutes
PICKUP_GRAPH_BYTES = 64 << 20
log = logging.getLogger(__name__)


def _sig(path: Path | None) -> FileSig:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path), st.st_mtime_ns, st.st_size)


def _newer(a: Path | None, b: Path | None) -> Path | None:
    sa, sb = _sig(a), _sig(b)
    if sa is None:
        return b if sb is not None else None
    if sb is None:
        return a
    return a if sa[1] >= sb[1] else b


def newest_files(places: list[Path], cut_short: list[str] | None = None) -> tuple[Path | None, Path | None]:
    """(newest fusion report, newest executed graph) over files and folders. A named file counts
    as a report when its name says so (``fusion_result*.json``), else as a graph (ATC JSON or GE text).
    A folder whose walk met its bound adds why to ``cut_short``."""
    report = graph = None
    for place in places:
        if place.is_dir():
            r, g, short = discover(place)
            report, graph = _newer(report, r), _newer(graph, g)
            if short and cut_short is not None:
                cut_short.append(short)
        elif place.exists():  # a named FIFO or device too: its reader refuses it with a clear error
            if fnmatch(place.name, REPORT_GLOB):
                report = _newer(report, place)
            else:
                graph = _newer(graph, place)
    return report, graph


@dataclass
class _Latest:
    sigs: tuple[FileSig, FileSig]
    ctx: FusionContext


class FusionPickup:
    """The latest fusion report and graph per dump watch. ``places(unit)`` gives a unit's job key
    and its places (None: the unit belongs to no dump watch)."""

    def __init__(self, places: Callable[[str], tuple[str, list[Path]] | None]) -> None:
        self.places = places
        self.latest: dict[str, _Latest] = {}
        self._lock = threading.Lock()

    def context(self, unit: str) -> FusionContext | None:
        """The job's current report and graph (None: none found); its ``errors`` only the first time."""
        found = self.places(unit)
        if found is None:
            return None
        job, places = found
        notes: list[str] = []   # a graph too big: reported with each new version of the files
        cut: list[str] = []     # walks cut short: a warning (no file went unread that was asked for)
        report, graph = newest_files(places, cut)
        sigs = (_sig(report), _sig(graph))
        with self._lock:
            cached = self.latest.get(job)
            if cached is not None and cached.sigs == sigs:
                return cached.ctx
        if sigs[1] is not None and sigs[1][2] > PICKUP_GRAPH_BYTES:
            notes.append(f"{graph}: too big for the daemon: {sigs[1][2]} bytes (limit {PICKUP_GRAPH_BYTES >> 20} MiB); "
                         f"not read (precision-agent fusion graph / scan --graph read it)")
            graph = None
        if report is None and graph is None:
            ctx = FusionContext()
        else:
            ctx = load_context(str(graph) if graph else None, [str(report)] if report else None)
        ctx.errors[:0] = notes
        ctx.warnings[:0] = cut
        with self._lock:
            self.latest[job] = _Latest(sigs, replace(ctx, errors=[], warnings=[]))
        return ctx

    def annotate(self, unit: str, result: dict[str, Any]) -> None:
        """Scan thread: name the passes behind the scan's first bad op, from the job's graph. A
        failure here is one error of the scan, never the loss of the scan itself."""
        from ..dumps.scan import with_fusion
        try:
            ctx = self.context(unit)
            if ctx is not None:
                with_fusion(result, ctx)
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must not drop the scan's findings
            log.exception("fusion files of %s", unit)
            result["errors"].append({"path": "fusion", "reason": f"{type(exc).__name__}: {exc}"[:500]})


def watch_places(watch_for: Callable[[str], Any]) -> Callable[[str], tuple[str, list[Path]] | None]:
    """``FusionPickup.places`` for the daemon's dump watches (``watch_for(unit)`` finds the watch)."""
    def places(unit: str) -> tuple[str, list[Path]] | None:
        w = watch_for(unit)
        if w is None or w.kind != "dump":
            return None
        own = [w.path] if w.path.is_dir() else []   # a watched file is a dump, not a graph
        return str(w.path), [*own, *w.fusion_files]
    return places

