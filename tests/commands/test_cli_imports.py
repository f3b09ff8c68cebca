"""What a `precision-agent compare` run imports: only its own command and the stages it uses.

Each command pays at start for every module it imports (`compare` is timed against `cat` in
bench/compare_msprobe.py, and numpy's import alone is a large part of it): the command line
registers only the command it runs, and a compare of msprobe `.pt` dumps never imports the other
readers, the scan command's machinery, the daemon's stages or the fusion file parsers. The
scanner (statistics of the tensors a verdict names) is imported only when a verdict names one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from support.commands import cli_modules
from support.torchpt import write_msprobe_pt

# every run of compare: none of these (module or any module below it)
NEVER = ("precision_agent.commands.scan", "precision_agent.commands.fusion", "precision_agent.commands.replay",
         "precision_agent.commands.ruletest", "precision_agent.commands.demo",
         "precision_agent.dumps.scan", "precision_agent.dumps.cann", "precision_agent.dumps.mindspore",
         "precision_agent.dumps.opdebug", "precision_agent.dumps.cache", "precision_agent.dumps.protobuf",
         "precision_agent.dumps.schedule", "precision_agent.fusion.graph", "precision_agent.fusion.report",
         "precision_agent.fusion.switch", "precision_agent.readers", "precision_agent.series",
         "precision_agent.engine", "precision_agent.detectors", "precision_agent.store", "precision_agent.config",
         "precision_agent.daemon", "precision_agent.exporters", "pydantic", "apscheduler", "watchdog",
         "prometheus_client", "ctypes.util")
# a comparison whose pairs are all equal: no verdict names a tensor, so no scanner either, and no
# fused-API catalogue (YAML) to consult
SCANNER = ("yaml", "precision_agent.dumps.tensorstats", "precision_agent.dumps.scanner", "precision_agent.dumps.windows",
           "precision_agent.dumps.pagecache", "precision_agent.kernels.scan_c", "precision_agent.kernels.scan_numpy")


def _dump(root: Path, drift: bool) -> Path:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 16), dtype=np.float32)
    w = rng.standard_normal((4, 16), dtype=np.float32)
    y = x @ w.T
    if drift:
        y = (x.astype(np.float16) @ w.T.astype(np.float16)).astype(np.float32)
    z = np.tanh(y)
    write_msprobe_pt(root / "step0" / "rank0", {"Functional.linear.0.forward": {"input_args": [x, w], "output": [y]},
                                                "Torch.tanh.0.forward": {"input_args": [y], "output": [z]}})
    return root


def _run(*args: object) -> tuple[int, dict, set[str]]:
    rc, out, modules, _err = cli_modules(*args)
    return rc, json.loads(out) if out.startswith("{") else {}, modules


def _imported(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


def test_a_diverging_compare_imports_neither_the_other_commands_nor_readers_nor_daemon_stages(tmp_path):
    rc, doc, modules = _run("compare", _dump(tmp_path / "bench", False), _dump(tmp_path / "target", True), "--json")
    assert rc == 1 and doc["first_diverging_op"]["op"] == "Functional.linear.0.forward"
    assert doc["first_diverging_op"]["target_stats"]["max"] is not None     # the scanner did run, for the verdict
    assert "precision_agent.compare.engine" in modules and "precision_agent.dumps.torchzip" in modules
    assert _imported(modules, NEVER) == []
    # the verdict consults the fused-API catalogue (fusion_suspect): ours is JSON, no YAML parser
    assert "fusion_suspect" in doc["first_diverging_op"] or "fusion_suspect" in doc
    assert _imported(modules, ("yaml",)) == []


def test_an_identical_compare_imports_neither_the_scanner_nor_yaml(tmp_path):
    rc, doc, modules = _run("compare", _dump(tmp_path / "bench", False), _dump(tmp_path / "same", False), "--json")
    assert rc == 0 and doc["identical"] is True
    assert _imported(modules, NEVER + SCANNER) == []


def test_the_whole_parser_still_lists_every_command(tmp_path):
    """main registers only the command it runs; usage and --help still name them all."""
    p = subprocess.run([sys.executable, "-m", "precision_agent", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    for name in ("run", "replay", "scan", "compare", "fusion", "rules", "demo"):
        assert f"    {name} " in p.stdout, name
    bad = subprocess.run([sys.executable, "-m", "precision_agent", "comapre"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "'compare'" in bad.stderr and "'scan'" in bad.stderr
