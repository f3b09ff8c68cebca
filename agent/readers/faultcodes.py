"""The catalogue of GPU/NPU driver fault codes the ``kernel`` log format tags its faults with:
``fault_codes.yml`` beside this module, extended by the file ``$PRECISION_AGENT_FAULT_CODES``
names (its entries first), read the way the metric map is (``metricmap.read_yaml``). A broken user
file is reported (``current_codes``' second value) while the shipped catalogue stays in force.

Families: ``nvidia_xid`` (codes are numbers: the Xid) and ``ascend`` (codes are the 32-bit fault
event ids, written ``"0x80E01801"`` or as a YAML number; kept as ``hex_code`` text)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from .metricmap import read_yaml

SHIPPED = Path(__file__).with_name("fault_codes.yml")
ENV_EXTRA = "PRECISION_AGENT_FAULT_CODES"
CLASSES = ("hardware", "application", "unknown")
FAMILIES = ("nvidia_xid", "ascend")


class CodesError(ValueError):
    """A fault-code file that cannot be used; the message names the file and the reason."""


@dataclass(frozen=True)
class FaultCode:
    code: int | str   # an Xid number, or an Ascend event id as hex_code text
    meaning: str
    cls: str          # one of CLASSES
    source: str = ""


def hex_code(value: int) -> str:
    """An Ascend fault event id as the catalogue and the alert's ``code`` label spell it: ``0x80E01801``."""
    return f"0x{value:08X}"


def _code(family: str, raw: object) -> int | str | None:
    """The entry's code in its family's form; None when it is not one."""
    if isinstance(raw, bool):
        return None
    if family == "nvidia_xid":
        return raw if isinstance(raw, int) and 0 <= raw < 1 << 20 else None
    if isinstance(raw, str):
        try:
            raw = int(raw.strip(), 16)
        except ValueError:
            return None
    return hex_code(raw) if isinstance(raw, int) and 0 <= raw < 1 << 32 else None


def _load(path: Path) -> dict[tuple[str, int | str], FaultCode]:
    doc = read_yaml(path, CodesError)
    if not isinstance(doc, dict) or any(k not in FAMILIES and not str(k).startswith("x-") for k in doc):
        raise CodesError(f"{path}: expected a mapping of {', '.join(FAMILIES)} to lists of codes "
                         "(and x-... keys of your own, e.g. anchors)")
    out: dict[tuple[str, int | str], FaultCode] = {}
    for family, entries in doc.items():
        if family not in FAMILIES:
            continue
        if not isinstance(entries, list):
            raise CodesError(f"{path}: {family}: expected a list of entries")
        for i, e in enumerate(entries):
            code = _code(family, e.get("code")) if isinstance(e, dict) else None
            if code is None or not isinstance(e.get("meaning"), str) or e.get("class") not in CLASSES:
                what = "a number" if family == "nvidia_xid" else "a 32-bit hex id such as \"0x80E01801\""
                raise CodesError(f"{path}: {family}[{i}]: needs 'code' ({what}), 'meaning' (text) and "
                                 f"'class' ({' | '.join(CLASSES)})")
            out.setdefault((family, code), FaultCode(code, e["meaning"].strip(), e["class"],
                                                     str(e.get("source") or "")))
    return out


@functools.lru_cache(maxsize=8)
def fault_codes(extra: str | None = None) -> dict[tuple[str, int | str], FaultCode]:
    """The shipped catalogue plus the file ``extra`` (its entries win); raises CodesError."""
    codes = _load(SHIPPED)
    if extra:
        codes = {**codes, **_load(Path(extra))}
    return codes


def current_codes() -> tuple[dict[tuple[str, int | str], FaultCode], str | None]:
    """The catalogue in force and, when ``$PRECISION_AGENT_FAULT_CODES`` cannot be used, why (the
    shipped catalogue alone is then in force)."""
    extra = os.environ.get(ENV_EXTRA) or None
    try:
        return fault_codes(extra), None
    except CodesError as exc:
        return fault_codes(None), str(exc)
