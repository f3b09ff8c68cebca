"""Which block kernels run: the compiled ones (one C pass per block) or numpy's (one pass per
operation). Both give the same statistics; the C kernels exist because a training host's cycles
belong to training, and numpy's pass-per-operation floor cost 3-20x more CPU per byte scanned.

The C kernels are optional build products (setup.py): a host without a compiler installs and
runs with numpy. ``PRECISION_AGENT_KERNELS`` picks at run time:

* ``auto`` (default): C where built and vectorised for this CPU (``fast()``: x86-64 with AVX2
  for compare, with AVX-512 for scan), numpy otherwise: elsewhere the portable loops' lane
  comparisons compile to scalar code, slower than numpy (docs/kernels.md);
* ``numpy``: numpy even where C is built (to rule the kernels out when chasing a number);
* ``c``: C or fail at start, for hosts that must not fall back silently.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from types import ModuleType
from typing import Iterator

ENV = "PRECISION_AGENT_KERNELS"
MODES = ("auto", "c", "numpy")
MODULES = {"scan": "precision_agent.dumps._scanc", "compare": "precision_agent.compare._comparec"}

_forced: str | None = None
_cache: dict[str, ModuleType | None] = {}
_fast: dict[str, bool] = {}   # fast() asks the CPU; the answer holds for the process


class KernelError(RuntimeError):
    """``PRECISION_AGENT_KERNELS`` names an unknown mode, or ``c`` where a kernel is not built."""


def mode() -> str:
    """The selected mode (a test's :func:`forced` mode first, then the environment)."""
    if _forced is not None:
        return _forced
    m = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if m not in MODES:
        raise KernelError(f"{ENV}={m!r}: expected one of {', '.join(MODES)}")
    return m


def _import(kind: str) -> ModuleType | None:
    if kind not in _cache:
        try:
            _cache[kind] = importlib.import_module(MODULES[kind])
        except ImportError:
            _cache[kind] = None
    return _cache[kind]


def get(kind: str) -> ModuleType | None:
    """The compiled module for ``kind`` ("scan" or "compare"), or None for the numpy path."""
    m = mode()
    if m == "numpy":
        return None
    mod = _import(kind)
    if mod is None and m == "c":
        raise KernelError(f"{ENV}=c but {MODULES[kind]} is not built (no C compiler at install?)")
    if m == "auto" and mod is not None and not fast(kind):
        return None
    return mod


def fast(kind: str) -> bool:
    """Whether the compiled module for ``kind`` is built and its loops are vectorised here."""
    if kind not in _fast:
        mod = _import(kind)
        _fast[kind] = mod is not None and bool(getattr(mod, "fast", lambda: True)())
    return _fast[kind]


def active() -> dict[str, str]:
    """{"scan": "c"|"numpy", "compare": ...}: what runs now (for build_info and the status API)."""
    out = {}
    for kind in MODULES:
        try:
            out[kind] = "c" if get(kind) is not None else "numpy"
        except KernelError:
            out[kind] = "missing"
    return out


def check() -> None:
    """Fail fast at start on a bad ``PRECISION_AGENT_KERNELS`` (raises :class:`KernelError`)."""
    for kind in MODULES:
        get(kind)


def built(kind: str) -> bool:
    """Whether the compiled module for ``kind`` can be imported (whatever the mode)."""
    return _import(kind) is not None


@contextlib.contextmanager
def forced(m: str) -> Iterator[None]:
    """Run the block inside with mode ``m`` (tests compare both paths in one process)."""
    global _forced
    if m not in MODES:
        raise KernelError(f"unknown kernel mode {m!r}")
    old, _forced = _forced, m
    try:
        yield
    finally:
        _forced = old
