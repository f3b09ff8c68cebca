"""The optional C kernels: how they are chosen, that the agent says which run, and that a host
without a C compiler still installs and runs on numpy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from support.agent import AgentProcess
from support.install import install
from precision_agent import kernels
from precision_agent.compare.metrics import compare_arrays

IN_CI = os.environ.get("CI") == "true"


def test_modes_pick_c_or_numpy(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.mode() == "auto"
    monkeypatch.setenv(kernels.ENV, "numpy")
    assert kernels.get("scan") is None and kernels.get("compare") is None
    assert kernels.active() == {"scan": "numpy", "compare": "numpy"}
    with kernels.forced("auto"):  # a test's forced mode wins over the environment
        assert kernels.mode() == "auto"
        assert (kernels.get("scan") is not None) == kernels.built("scan")
    assert kernels.mode() == "numpy"  # restored
    monkeypatch.setenv(kernels.ENV, " C ")
    assert kernels.mode() == "c"
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(kernels.KernelError, match="PRECISION_AGENT_KERNELS='fast'"):
        kernels.check()
    with pytest.raises(kernels.KernelError):
        with kernels.forced("fast"):
            pass


def test_auto_takes_c_on_every_variant_this_cpu_runs(monkeypatch):
    """auto picks C wherever it is built, whichever variant the CPU runs (x86-64 with AVX-512 or
    AVX2 only, aarch64's NEON: all measured faster than numpy), decided once per process; the
    old selection gave numpy below AVX-512 for the scanner."""
    if not (kernels.built("scan") and kernels.built("compare")):
        pytest.skip("the C kernels are not built here")
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert {"avx512", "avx2", "neon"} <= set(kernels.VECTORISED)   # aarch64: its module's one variant
    assert set(kernels.variants()) <= set(kernels.VECTORISED)
    for v in kernels.variants():
        with kernels.forced_variant(v):
            assert kernels.variant("scan") == kernels.variant("compare") == v
            assert kernels.active() == {"scan": "c", "compare": "c"}
    assert kernels.variant("scan") == kernels.variants()[0]   # restored: the best one
    with pytest.raises(ValueError, match="not available"):
        with kernels.forced_variant("sve512"):
            pass


@pytest.mark.skipif(not IN_CI, reason="CI builds with a C compiler; elsewhere the kernels are optional")
def test_ci_builds_both_kernels():
    assert kernels.built("scan") and kernels.built("compare")


def test_bad_mode_fails_every_command_at_start(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(4, dtype=np.float32))
    env = {**os.environ, kernels.ENV: "gpu"}
    for cmd in (["scan", str(tmp_path)], ["run", "--watch", str(tmp_path), "--state", str(tmp_path / "s")]):
        p = subprocess.run([sys.executable, "-m", "precision_agent", *cmd], capture_output=True, text=True,
                           timeout=60, env=env)
        assert p.returncode == 2, (cmd, p.stdout, p.stderr)
        assert "PRECISION_AGENT_KERNELS='gpu'" in p.stderr


def test_agent_reports_its_kernels(tmp_path):
    watch = tmp_path / "logs"
    watch.mkdir()
    agent = AgentProcess(watch, tmp_path / "state").start(env={kernels.ENV: "numpy"})
    try:
        status = json.loads(agent.get("/api/v1/status"))["data"]
        assert status["kernels"] == {"scan": "numpy", "compare": "numpy"}
        metrics = agent.get("/metrics")
        assert 'precision_agent_kernel_info{impl="numpy",kind="scan"} 1.0' in metrics
        assert 'precision_agent_kernel_info{impl="numpy",kind="compare"} 1.0' in metrics
    finally:
        agent.stop()


def _run_installed(target, code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=target.parent, env={**os.environ, "PYTHONPATH": str(target), **(env or {})})


def test_install_without_a_compiler_runs_on_numpy(tmp_path):
    """CC=false: every compile fails, the optional extensions are skipped, the install succeeds,
    scans and compares run on numpy, and mode ``c`` refuses to start instead of falling back."""
    target = tmp_path / "site"
    p = install(target, {"CC": "false", "LDSHARED": "false"})
    assert p.returncode == 0, p.stderr
    assert not list((target / "precision_agent").rglob("*.so"))
    code = ("import numpy as np; from precision_agent import kernels;"
            "from precision_agent.dumps.scanner import scan_array;"
            "from precision_agent.compare.metrics import compare_arrays;"
            "a = np.array([1, 2, np.nan, 0], np.float32);"
            "s = scan_array(a); d = compare_arrays(a, a);"
            "print(kernels.active(), s.nan, s.max, d.bitwise_equal)")
    r = _run_installed(target, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["{'scan':", "'numpy',", "'compare':", "'numpy'}", "1", "2.0", "True"]
    r = _run_installed(target, "from precision_agent.commands.cli import main; raise SystemExit(main(['scan', '.']))",
                       {kernels.ENV: "c"})
    assert r.returncode == 2 and "is not built" in r.stderr, r.stderr


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None and not IN_CI, reason="no C compiler")
def test_plain_install_with_a_compiler_carries_the_kernels(plain_install):
    """A plain (non-editable) install builds both modules with every variant this architecture
    has; auto runs them, and the compare result is the development build's, bit for bit."""
    target, p = plain_install
    assert p.returncode == 0, p.stderr
    assert list((target / "precision_agent" / "kernels").glob("_scan*.so"))
    assert list((target / "precision_agent" / "kernels").glob("_compare*.so"))
    code = ("import numpy as np; from precision_agent import kernels; kernels.check();"
            "from precision_agent.compare.metrics import compare_arrays;"
            "x = np.arange(1, 5001, dtype=np.float32); y = x * np.float32(1.001);"
            "print(kernels.active(), kernels.variants(), repr(compare_arrays(x, y).metrics['KullbackLeiblerDivergence']))")
    r = _run_installed(target, code, {kernels.ENV: "auto"})
    assert r.returncode == 0 and str({"scan": "c", "compare": "c"}) in r.stdout, r.stderr
    assert str(kernels.variants()) in r.stdout
    x = np.arange(1, 5001, dtype=np.float32)
    with kernels.forced("c"):
        want = compare_arrays(x, x * np.float32(1.001)).metrics["KullbackLeiblerDivergence"]
    assert float(r.stdout.split()[-1]) == want
