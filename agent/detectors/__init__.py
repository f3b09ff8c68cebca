"""Rule kinds: one module per kind in this package, found at import and registered by ``kind``."""

from __future__ import annotations

from ..registry import discover
from .base import Clear, Detector, Hit, Params

KINDS: dict[str, type[Detector]] = {c.kind: c for c in sorted(discover(__name__, __path__, Detector, "kind"),
                                                              key=lambda c: c.kind)}

__all__ = ["Clear", "Detector", "Hit", "KINDS", "Params"]
