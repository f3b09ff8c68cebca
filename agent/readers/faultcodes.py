"""The catalogue of GPU/NPU driver fault codes the ``kernel`` log format tags its faults with:
``fault_codes.yml`` beside this module, extended by the file ``$PRECISION_AGENT_FAULT_CODES``
names (its entries first), read the way the metric map is (``metricmap.read_yaml``). A broken user
file is reported (``current_codes``' second value) while the shipped catalogue stays in force."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from .metricmap import read_yaml

SHIPPED = Path(__file__).with_name("fault_codes.yml")
ENV_EXTRA = "PRECISION_AGENT_FAULT_CODES"
CLASSES = ("hardware", "application", "unknown")
FAMILIES = ("nvidia_xid",)


class CodesError(ValueError):
    """A fault-code file that cannot be used; the message names the file and the reason."""


@dataclass(frozen=True)
class FaultCode:
    code: int
    meaning: str
    cls: str          # one of CLASSES
    source: str = ""


def _load(path: Path) -> dict[tuple[str, int], FaultCode]:
    doc = read_yaml(path, CodesError)
    if not isinstance(doc, dict) or any(k not in FAMILIES for k in doc):
        raise CodesError(f"{path}: expected a mapping of {', '.join(FAMILIES)} to lists of codes")
    out: dict[tuple[str, int], FaultCode] = {}
    for family, entries in doc.items():
        if not isinstance(entries, list):
            raise CodesError(f"{path}: {family}: expected a list of entries")
        for i, e in enumerate(entries):
            ok = (isinstance(e, dict) and isinstance(e.get("code"), int) and not isinstance(e["code"], bool)
                  and isinstance(e.get("meaning"), str) and e.get("class") in CLASSES)
            if not ok:
                raise CodesError(f"{path}: {family}[{i}]: needs 'code' (a number), 'meaning' (text) and "
                                 f"'class' ({' | '.join(CLASSES)})")
            out.setdefault((family, e["code"]), FaultCode(e["code"], e["meaning"].strip(), e["class"],
                                                          str(e.get("source") or "")))
    return out


@functools.lru_cache(maxsize=8)
def fault_codes(extra: str | None = None) -> dict[tuple[str, int], FaultCode]:
    """The shipped catalogue plus the file ``extra`` (its entries win); raises CodesError."""
    codes = _load(SHIPPED)
    if extra:
        codes = {**codes, **_load(Path(extra))}
    return codes


def current_codes() -> tuple[dict[tuple[str, int], FaultCode], str | None]:
    """The catalogue in force and, when ``$PRECISION_AGENT_FAULT_CODES`` cannot be used, why (the
    shipped catalogue alone is then in force)."""
    extra = os.environ.get(ENV_EXTRA) or None
    try:
        return fault_codes(extra), None
    except CodesError as exc:
        return fault_codes(None), str(exc)
