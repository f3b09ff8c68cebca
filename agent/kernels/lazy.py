"""numpy, imported when first used rather than when a module that may use it is imported.

numpy's import is the largest part of a one-shot command's start (0.09-0.16 s on the 2-core CI
host, two to three times what ``cat`` needs to read a 90 MB dump pair from the page cache), and
``compare`` needs none of numpy for a float pair that the C kernel reads whole
(:func:`.compare_raw.passes`). The modules on that path bind ``np`` to :data:`np` below: the
first attribute read imports numpy (under the import lock, so two threads importing at once get
one module) and keeps the attribute on the proxy, so a later read is a plain instance lookup, as
fast as a module's. The daemon and every other command import numpy anyway; for them nothing
changes but the moment of the import.

Module-level code of those modules must not read ``np`` (constants such as float64's eps are
written out), else the import happens at once again: tests/kernels/test_lazy.py checks that the
compare command's modules import without numpy.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyNumpy:
    """Stands for the ``numpy`` module; each attribute is fetched from it once, on first use."""

    def __getattr__(self, name: str) -> Any:   # only for names not yet kept in __dict__
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)   # copy/pickle probes: no import for them
        value = getattr(importlib.import_module("numpy"), name)
        setattr(self, name, value)
        return value

    def __repr__(self) -> str:
        return "<numpy, imported on first use>"


np: Any = LazyNumpy()
