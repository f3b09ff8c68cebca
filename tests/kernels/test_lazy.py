"""numpy imported on first use (agent/kernels/lazy.py): the compare command's modules import
without it, the proxy hands out numpy's own objects and keeps them, and dunder probes (copy,
pickle, hasattr checks) do not import it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from precision_agent.kernels.lazy import LazyNumpy

COMMAND_MODULES = ["precision_agent.commands.cli", "precision_agent.commands.compare",
                   "precision_agent.commands.tools", "precision_agent.compare.engine",
                   "precision_agent.compare.pairing", "precision_agent.compare.report",
                   "precision_agent.fusion.context", "precision_agent.dumps.scanner",
                   "precision_agent.dumps.tensorstats", "precision_agent.kernels.compare_raw"]


def test_the_compare_command_modules_import_without_numpy():
    code = textwrap.dedent(f"""
        import importlib, sys
        for m in {COMMAND_MODULES!r}:
            importlib.import_module(m)
        print("numpy" in sys.modules)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False", "a module on compare's path imports numpy at import time"


def test_the_proxy_gives_numpy_objects_and_keeps_them():
    import numpy
    lazy = LazyNumpy()
    assert lazy.float32 is numpy.float32 and lazy.ndarray is numpy.ndarray
    assert "float32" in vars(lazy)           # kept: the next read is an instance lookup
    assert lazy.zeros(3).sum() == 0.0
    assert getattr(lazy, "no_such_name_in_numpy", None) is None


def test_dunder_probes_do_not_import_numpy():
    code = textwrap.dedent("""
        import copy, sys
        from precision_agent.kernels.lazy import LazyNumpy
        lazy = LazyNumpy()
        assert not hasattr(lazy, "__array_interface__")
        copy.copy(lazy)
        print("numpy" in sys.modules)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
