"""Rule kinds: one module per kind in this package, found at import and registered by ``kind``."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Clear, Detector, Hit, Params


def _discover() -> dict[str, type[Detector]]:
    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "base" and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")
    found: dict[str, type[Detector]] = {}
    stack = list(Detector.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if getattr(cls, "kind", None) and not getattr(cls, "__abstractmethods__", None):
            found[cls.kind] = cls
    return dict(sorted(found.items()))


KINDS: dict[str, type[Detector]] = _discover()

__all__ = ["Clear", "Detector", "Hit", "KINDS", "Params"]
