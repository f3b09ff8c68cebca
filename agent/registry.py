"""Plug-in discovery shared by parsers and rule kinds: every module of a package is imported,
and each concrete subclass of the base class is registered under its key attribute."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Iterable, TypeVar

T = TypeVar("T", bound=type)


def discover(package: str, path: Iterable[str], base: T, key: str) -> list[T]:
    """Concrete subclasses of ``base`` with a non-empty ``key`` attribute, from ``package``."""
    for mod in pkgutil.iter_modules(path):
        if mod.name != "base" and not mod.name.startswith("_"):
            importlib.import_module(f"{package}.{mod.name}")
    found: dict[str, T] = {}
    stack = list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if getattr(cls, key, None) and not getattr(cls, "__abstractmethods__", None):
            found[getattr(cls, key)] = cls
    return list(found.values())
