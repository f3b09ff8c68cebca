"""``fusion_switch.cfg``: the file CANN reads (``fusion_switch_file`` session option, ATC
``--fusion_switch_file``) to turn fusion passes off. Its shape, as precision_tool ships it:

    {
      "Switch": {
        "GraphFusion": {"ConvBatchnormFusionPass": "off"},
        "UBFusion": {"TbeEltwiseFusionPass": "off"}
      }
    }

``"ALL": "off"`` in a section turns every pass of that kind off. A pass is put in the section the
fusion report lists it under (both when it is listed under both).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .report import FusionReport

GRAPH, UB = "GraphFusion", "UBFusion"
ALL = "ALL"


class SwitchError(ValueError):
    pass


@dataclass(frozen=True)
class SwitchConfig:
    """The passes a switch file turns off, per section (``ALL`` stands for every pass of a kind)."""
    graph_off: tuple[str, ...] = ()
    ub_off: tuple[str, ...] = ()

    def to_json(self) -> dict[str, dict[str, dict[str, str]]]:
        return {"Switch": {GRAPH: {p: "off" for p in self.graph_off}, UB: {p: "off" for p in self.ub_off}}}

    def render(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @property
    def passes(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.graph_off) | set(self.ub_off)))


def switch_off(passes: list[str] | tuple[str, ...], report: FusionReport) -> SwitchConfig:
    """The switch file that turns off exactly ``passes``, each in the section(s) the report lists
    it under. A pass the report does not know is an error (its section would be a guess)."""
    graph: list[str] = []
    ub: list[str] = []
    for p in sorted(set(passes)):
        kinds = report.kinds(p)
        if not kinds:
            raise SwitchError(f"{p}: not a pass of the fusion report, so neither GraphFusion nor UBFusion is known")
        if GRAPH in kinds:
            graph.append(p)
        if UB in kinds:
            ub.append(p)
    return SwitchConfig(tuple(graph), tuple(ub))


def parse_switch(text: str, file: str = "<text>") -> SwitchConfig:
    """Read a switch file back: the passes it turns off (``"on"`` entries are left out)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SwitchError(f"{file}: not JSON: {exc.msg} at line {exc.lineno}") from None
    sw = doc.get("Switch") if isinstance(doc, dict) else None
    if not isinstance(sw, dict):
        raise SwitchError(f"{file}: no 'Switch' object")
    off: dict[str, tuple[str, ...]] = {}
    for section in (GRAPH, UB):
        entries = sw.get(section, {})
        if not isinstance(entries, dict):
            raise SwitchError(f"{file}: Switch.{section} is not an object")
        bad = [k for k, v in entries.items() if v not in ("on", "off")]
        if bad:
            raise SwitchError(f"{file}: Switch.{section}.{bad[0]}: expected \"on\" or \"off\"")
        off[section] = tuple(sorted(k for k, v in entries.items() if v == "off"))
    return SwitchConfig(off[GRAPH], off[UB])


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename, so a
    reader (or a crash) never sees half a file."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_switch(path: str | os.PathLike[str], cfg: SwitchConfig) -> None:
    write_atomic(path, cfg.render())
