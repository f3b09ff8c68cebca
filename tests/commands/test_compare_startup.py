"""What `precision-agent compare` spends around the comparison itself (bench/compare_msprobe.py
times it against `cat`): the interpreter's teardown is skipped at the process's own entry, numpy's
import runs without garbage collections, and the default `--jobs` is bounded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from precision_agent.commands import compare as compare_cmd
from support.dumps import tiny_net

# An atexit hook stands for the interpreter's teardown; the report must come out whole anyway.
ENTRY = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("TEARDOWN RAN\\n"))
from precision_agent.commands.cli import main
sys.exit(main({argv}))
"""


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    tiny_net(tmp_path / "bench")
    tiny_net(tmp_path / "drift", half_fc2=True)
    return tmp_path / "bench", tmp_path / "drift"


def _entry(argv: str, *args: object, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENTRY.format(argv=argv), *map(str, args)],
                          text=True, timeout=120, **kw)


def test_the_process_entry_skips_teardown_and_keeps_status_and_every_byte(tmp_path):
    bench, drift = _pair(tmp_path)
    piped = _entry("", "compare", bench, drift, "--json", capture_output=True)
    assert piped.returncode == 1, piped.stderr
    assert json.loads(piped.stdout)["first_diverging_op"]["op"] == "Functional.linear.1.forward"
    assert "TEARDOWN RAN" not in piped.stderr
    # to a file (block-buffered, not a pipe): flushed before the process ends, text report too
    out = tmp_path / "report.txt"
    with out.open("w") as fh:
        to_file = _entry("", "compare", bench, drift, stdout=fh, stderr=subprocess.PIPE)
    assert to_file.returncode == 1 and "TEARDOWN RAN" not in to_file.stderr
    text = out.read_text()
    assert "lost_precision: Functional.linear.1.forward lost precision" in text and text.endswith("\n")
    same = _entry("", "compare", bench, bench, "--json", capture_output=True)
    assert same.returncode == 0 and json.loads(same.stdout)["identical"] is True
    missing = _entry("", "compare", bench, tmp_path / "nowhere", capture_output=True)
    assert missing.returncode == 2 and "nowhere" in missing.stderr


def test_a_caller_of_main_with_arguments_keeps_its_process(tmp_path):
    """main(argv) from a program or test returns the status, and that program goes on."""
    bench, drift = _pair(tmp_path)
    p = _entry("sys.argv[1:]", "compare", bench, drift, "--json", capture_output=True)
    assert p.returncode == 1 and "TEARDOWN RAN" in p.stderr
    assert json.loads(p.stdout)["pairs"] == 12


def test_a_closed_stdout_still_ends_quietly_with_141(tmp_path):
    bench, drift = _pair(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "precision_agent", "compare", str(bench), str(drift), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()   # the reader went away before the report
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err


PROBE = """
import gc, sys
seen = []
gc.callbacks.append(lambda phase, info: phase == "start" and seen.append(
    ("numpy" in sys.modules, "precision_agent.compare.report" in sys.modules)))
from precision_agent.commands.cli import main
rc = main(sys.argv[1:])
print(rc, gc.isenabled(), sum(1 for np_, report in seen if np_ and not report), file=sys.stderr)
"""


def test_numpys_import_runs_without_collections_and_the_collector_is_back_after(tmp_path):
    bench, drift = _pair(tmp_path)
    p = subprocess.run([sys.executable, "-c", PROBE, "compare", str(bench), str(drift), "--json"],
                       capture_output=True, text=True, timeout=120)
    rc, enabled, during_imports = p.stderr.split()[-3:]
    assert (rc, enabled, during_imports) == ("1", "True", "0"), p.stderr


@pytest.mark.parametrize("cpus, expected", [(1, 1), (2, 2), (8, 8), (16, 8), (192, 8)])
def test_the_default_jobs_are_the_usable_cpus_at_most_eight(monkeypatch, cpus, expected):
    monkeypatch.setattr(compare_cmd.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert compare_cmd.default_jobs() == expected == min(compare_cmd.MAX_DEFAULT_JOBS, cpus)
