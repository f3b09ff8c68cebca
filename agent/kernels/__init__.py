"""The block kernels of the dump scanner and the dump comparison, and which of them run.

Each has two implementations that give the same statistics: numpy's (:mod:`.scan_numpy`,
:mod:`.compare_numpy`: one pass over memory per operation) and a compiled one (``scan.c``,
``compare.c`` with their glue :mod:`.scan_c`, :mod:`.compare_c`: one pass per block for all of
them), which exists because a training host's cycles belong to training.

The compiled kernels are optional build products (setup.py): a host without a compiler installs
and runs with numpy. Each C source is compiled once per variant (vector width and instruction
set: AVX-512, AVX2, baseline SSE2 on x86-64; NEON on aarch64) and the module picks the best
variant the CPU runs when it is imported. ``PRECISION_AGENT_KERNELS`` picks the implementation:

* ``auto`` (default): C where built and its variant is one of ``VECTORISED`` (today all of them),
  numpy otherwise; decided once per process;
* ``numpy``: numpy even where C is built (to rule the kernels out when chasing a number);
* ``c``: C or fail at start, for hosts that must not fall back silently.

Tests and the benchmarks compare paths in one process with :func:`forced` (a mode) and
:func:`forced_variant` (a variant of the compiled loops).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from types import ModuleType
from typing import Iterator

ENV = "PRECISION_AGENT_KERNELS"
MODES = ("auto", "c", "numpy")
MODULES = {"scan": "precision_agent.kernels._scan", "compare": "precision_agent.kernels._compare"}
# the variants auto takes: every one whose loops were measured faster than numpy (bench/README.md;
# aarch64's by its vector code, docs/kernels.md): all that setup.py builds today
VECTORISED = ("avx512", "avx2", "baseline", "neon")

_forced: str | None = None
_cache: dict[str, ModuleType | None] = {}
_auto: dict[str, bool] = {}   # auto's answer per kind, decided once per process


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
    if m == "auto" and mod is not None:
        if kind not in _auto:
            _auto[kind] = mod.variant() in VECTORISED
        if not _auto[kind]:
            return None
    return mod


def variant(kind: str) -> str | None:
    """The variant of ``kind``'s compiled loops in use ("avx512", "avx2", "baseline", "neon"),
    None where the module is not built."""
    mod = _import(kind)
    return None if mod is None else mod.variant()


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


@contextlib.contextmanager
def forced_variant(name: str) -> Iterator[None]:
    """Run the block inside on variant ``name`` of every built kernel (tests and bench only:
    the variant is process-wide). ValueError where the CPU or the build lacks it."""
    mods = [m for m in map(_import, MODULES) if m is not None]
    for mod in mods:
        if name not in mod.variants():
            raise ValueError(f"kernel variant {name!r} not available here: {mod.variants()}")
    old = [mod.variant() for mod in mods]
    try:
        for mod in mods:
            mod.set_variant(name)
        yield
    finally:
        for mod, v in zip(mods, old):
            mod.set_variant(v)


def variants() -> tuple[str, ...]:
    """The variants every built kernel can run on this CPU, best first (empty: none built)."""
    mods = [m for m in map(_import, MODULES) if m is not None]
    return tuple(v for v in mods[0].variants() if all(v in m.variants() for m in mods)) if mods else ()
