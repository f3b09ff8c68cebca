"""Where the time of one ``precision-agent scan`` run goes, as a user runs it (a fresh process):
the real command line (``cli.main``) in a subprocess whose stages are timed from outside the
agent's code, by wrapping the functions the command calls (nothing of the agent is changed).

Phases, in seconds of wall time from the moment the parent spawned the process (``time.time()``
on both sides): ``interpreter`` (Python and site up to the first line of the probe), ``imports``
(the command's modules), ``rules`` (loading the rule files), ``prepare`` (the rest before the scan:
argument parsing, the fusion context), ``scan_dump`` (walk, discovery, every tensor's pass, first
bad op), ``findings`` (the rules judging the statistics), ``output`` (report assembly and the
JSON), ``exit`` (from ``main``'s return until the parent saw the process end: interpreter
shutdown). Also the process's CPU time and minor page faults (``wait4``). Used by
bench/scantree.py to split the command's time beyond the in-process scan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

_PROBE = r"""
import json, sys, time
T = {"start": time.time()}
import precision_agent.commands.scan as cs
import precision_agent.engine.rulefile as rf
from precision_agent.commands.cli import main
T["imported"] = time.time()

def wrap(mod, name, before=None, after=None):
    fn = getattr(mod, name)
    def timed(*a, **k):
        if before and before not in T:
            T[before] = time.time()
        try:
            return fn(*a, **k)
        finally:
            if after:
                T[after] = time.time()
    setattr(mod, name, timed)

wrap(rf, "load_rules", "rules_start", "rules_end")   # run() imports it on use: from this module
wrap(cs, "scan_dump", "scan_start", "scan_end")
wrap(cs, "findings", None, "findings_end")
rc = main(sys.argv[1:])
T["main_end"] = time.time()
sys.stderr.write("\nCLIPHASES " + json.dumps(T) + "\n")
sys.exit(rc)
"""

PHASES = ("interpreter", "imports", "rules", "prepare", "scan_dump", "findings", "output", "exit")


def cli_phases(python: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``precision-agent ARGS`` (with ``python``) once; its phases (see the module docstring)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.time()
        p = subprocess.Popen([python, "-c", _PROBE, *args], env=env, stdout=out, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        t_end = time.time()
        p.returncode = os.waitstatus_to_exitcode(status)
        nout = out.tell()
        err.seek(0)
        text = err.read().decode(errors="replace")
    marks = {}
    for line in text.splitlines():
        if line.startswith("CLIPHASES "):
            marks = json.loads(line[len("CLIPHASES "):])
    if not marks:
        raise RuntimeError(f"no phases from {args}: exit {p.returncode}: {text[-2000:]}")
    m = {k: v - t0 for k, v in marks.items()}
    rules_end = m.get("rules_end", m["imported"])
    scan_start, scan_end = m.get("scan_start", rules_end), m.get("scan_end", rules_end)
    findings_end = m.get("findings_end", scan_end)
    phases = dict(zip(PHASES, (m["start"], m["imported"] - m["start"],
                               rules_end - m.get("rules_start", m["imported"]),
                               scan_start - rules_end, scan_end - scan_start, findings_end - scan_end,
                               m["main_end"] - findings_end, (t_end - t0) - m["main_end"])))
    return {"wall_s": t_end - t0, "phases_s": phases, "exit_status": p.returncode, "stdout_bytes": nout,
            "cpu_s": ru.ru_utime + ru.ru_stime, "minflt": ru.ru_minflt}


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run, with each phase's minimum over all runs beside it."""
    fastest = min(runs, key=lambda r: r["wall_s"])
    return dict(fastest, phases_min_s={k: min(r["phases_s"][k] for r in runs) for k in PHASES})


def report_line(label: str, r: dict[str, Any]) -> str:
    ph = r["phases_s"]
    return f"    {label}: {r['wall_s']:.3f} s = " + " + ".join(f"{k} {ph[k]:.3f}" for k in PHASES)


if __name__ == "__main__":   # python -m bench.cliphases scan --json --jobs 2 TREE
    res = cli_phases(sys.executable, sys.argv[1:])
    print(report_line("scan", res))
    print(json.dumps(res, indent=2))
