"""``trainers``: the canary for the next trainer release. Does the agent still read what today's
trainers write, and page where a run goes NaN?

Installs the newest transformers (and the newest 4.57.x), Lightning (with and without ``rich``)
and DeepSpeed, each in a cached venv with CPU torch (bench/trainer_runs.py), trains a tiny model
per trainer with a NaN planted at step 30 and without, while the real daemon
(``precision-agent run --watch ROOT``) follows the run folders as a user's would; then runs
``precision-agent replay --json`` on every source each run wrote (``train.log``, TensorBoard event
files, Lightning's ``metrics.csv``). It prints trainer × source × (records, first non-finite
step, first page step, seconds from the fault to the daemon's page) and fails (``ok`` false, exit 1
from ``python -m bench.trainers``) when a faulty source does not page at the expected step or a
healthy one pages. A trainer that does not install or start (DeepSpeed on a host without a
compiler) is reported as skipped with its reason. Not part of ``make bench``: it downloads; the
test ``tests/benchmarks/test_trainers_canary.py`` runs it in CI.

Steps: a source that prints steps (event files, CSV) must page at ``Run.expect_page``; HF's stdout
dicts carry no step, so the n-th training dict of ``train.log`` is step n × ``logging_steps``
(what HF does); Lightning's progress bar has no step (tqdm frames; rich writes only its last
frame): its stdout must page, at whatever line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from precision_agent.readers.runs import run_labels

from . import common
from .trainer_runs import CACHE, PINNED, SERIES, Run, ensure_venv, newest, runs_for, train

SOURCES = ("train.log", "events.out.tfevents.*", "metrics.csv")
EVALUATION_INTERVAL_S = 1.0   # the daemon's default evaluation_interval
SETTLE_EVALUATIONS = 2        # rule evaluations waited for once the daemon has parsed every record
SETTLE_LIMIT_S = 60.0         # the deadline of those conditions after the trainer's end


def versions(pinned: bool) -> list[tuple[str, str]]:
    wanted = [(trainer, prefix, pin) for trainer, prefixes in SERIES.items()
              for prefix, pin in zip(prefixes, PINNED[trainer])]
    if pinned:
        return [(trainer, pin) for trainer, _prefix, pin in wanted]
    with ThreadPoolExecutor(len(wanted)) as pool:  # one ``pip index`` look-up each, at once
        found = list(pool.map(lambda w: newest(w[0], w[1]), wanted))
    return [(trainer, got or pin) for (trainer, _prefix, pin), got in zip(wanted, found)]


def sources(run_dir: Path) -> list[Path]:
    found = []
    for pattern in SOURCES:
        found += sorted(p for p in run_dir.rglob(pattern) if p.is_file())
    return found


def replay(path: Path) -> tuple[dict[str, Any] | None, int]:
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "replay", "--json", str(path)],
                          capture_output=True, text=True, timeout=300)
    try:
        return json.loads(proc.stdout), proc.returncode
    except ValueError:
        return None, proc.returncode


def hf_step_of_line(log: Path, line: int, logging_steps: int) -> int | None:
    """The step of the HF training dict on ``line``: HF logs every ``logging_steps`` steps, so the
    n-th ``{'loss': ...}`` dict is step n × logging_steps (its own ordinal, not the agent's reading)."""
    n = 0
    for i, text in enumerate(log.read_bytes().decode(errors="replace").split("\n"), 1):  # \r frames stay put
        n += text.count("{'loss'")
        if i == line:
            return n * logging_steps if "{'loss'" in text else None
    return None


def page_step(run: Run, src: Path, step: int | None, line: int | None) -> int | None:
    if step is None and line is not None and src.name == "train.log" and run.trainer == "transformers":
        return hf_step_of_line(src, line, run.logging_steps)
    return step


def judge(run: Run, src: Path, rep: dict[str, Any] | None, daemon_page: dict[str, Any] | None = None,
          fault_at: float | None = None, daemon: bool = True) -> dict[str, Any]:
    """One row of the table: what replay (and, with ``daemon``, the daemon) made of one source."""
    row: dict[str, Any] = {"trainer": run.name, "variant": run.variant, "source": src.name,
                           "records": rep["records"] if rep else None, "first_nonfinite": None,
                           "page_step": None, "daemon_page_step": None, "seconds_to_page": None}
    if rep is None:
        row["ok"], row["why"] = False, "replay gave no JSON"
        return row
    if rep["nonfinite"]:
        first = rep["nonfinite"][0]
        row["first_nonfinite"] = page_step(run, src, first["step"], first["line"])
    pages = [f for f in rep["findings"] if f["severity"] in ("page", "critical")]
    if pages:
        row["page_step"] = page_step(run, src, pages[0]["step"], pages[0]["line"])
        row["page_rule"] = pages[0]["rule"]
    if daemon_page is not None:
        ev = daemon_page["evidence"]
        row["daemon_page_step"] = page_step(run, src, ev.get("step"), (ev.get("source") or {}).get("line"))
        if fault_at is not None:
            row["seconds_to_page"] = round(daemon_page["_seen"] - fault_at, 2)
    # Lightning's progress bar prints no step; a run whose expect_page is None must page, at any step
    stepless = (src.name == "train.log" and run.trainer == "lightning") or run.expect_page is None
    if not run.fault:
        row["ok"] = not pages and daemon_page is None
        row["why"] = "" if row["ok"] else "a healthy run paged"
    elif stepless:
        row["ok"] = bool(pages) and (daemon_page is not None or not daemon)
        row["why"] = "" if row["ok"] else "no page (replay or daemon)"
    else:
        row["ok"] = row["page_step"] == run.expect_page and (row["daemon_page_step"] == run.expect_page or not daemon)
        row["why"] = "" if row["ok"] else f"expected a page at step {run.expect_page} in replay and daemon"
    if rep["records"] == 0:
        row["why"] = (row["why"] + "; 0 records").lstrip("; ")
    return row


def _daemon_pages(agent: common.AgentProcess, seen: dict[str, dict[str, Any]]) -> None:
    """First page alert per source file, stamped with when it was first seen."""
    status, body = common.http_get(agent.port, "/api/v1/alerts")
    if status != 200:
        return
    for a in json.loads(body)["data"]["alerts"]:
        if a["labels"].get("severity") not in ("page", "critical"):
            continue
        path = ((a.get("evidence") or {}).get("source") or {}).get("path")
        if path and path not in seen:
            seen[path] = {**a, "_seen": time.time()}
        # several files of one run (Lightning's event file and metrics.csv log the same values)
        # feed one series: one incident, one page, whose source is the file read first
        run_key = "run:" + a["labels"].get("run", "")
        if run_key not in seen:
            seen[run_key] = {**a, "_seen": time.time()}


def run_one(run: Run, root: Path, timeout: float) -> list[dict[str, Any]]:
    """One run, followed by its own daemon watching its folder (runs are told apart by folder;
    every run's stdout is a ``train.log``)."""
    out = root / run.name / run.variant
    out.mkdir(parents=True, exist_ok=True)
    seen: dict[str, dict[str, Any]] = {}
    with common.AgentProcess(out) as agent:
        return _follow(run, out, agent, seen, timeout)


def _follow(run: Run, out: Path, agent: common.AgentProcess, seen: dict[str, dict[str, Any]],
            timeout: float) -> list[dict[str, Any]]:
    proc = train(run, out)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        _daemon_pages(agent, seen)
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    srcs = sources(out)
    with ThreadPoolExecutor(max(1, len(srcs))) as pool:  # the replays run while the daemon is polled
        pending = pool.map(replay, srcs)
        reps = _settle(run, out, agent, seen, srcs, pending)
    fault_file = out / "fault_at"
    fault_at = float(fault_file.read_text()) if fault_file.exists() else None
    rows = []
    for src, (rep, _rc) in zip(srcs, reps):
        rows.append(judge(run, src, rep, _page_of(run, out, src, seen), fault_at) | {"exit": proc.returncode})
    if not rows:
        rows.append({"trainer": run.name, "variant": run.variant, "source": "-", "ok": False,
                     "why": f"the trainer wrote nothing (exit {proc.returncode}); see {out / 'train.log'}"})
    return rows


def _page_of(run: Run, out: Path, src: Path, seen: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    return seen.get(str(src)) or seen.get(str(src.resolve())) or \
        seen.get("run:" + run_labels(str(src), "file", {}, str(out))["run"])


def _settle(run: Run, out: Path, agent: common.AgentProcess, seen: dict[str, dict[str, Any]], srcs: list[Path],
            pending: Iterator[tuple[dict[str, Any] | None, int]], limit: float = SETTLE_LIMIT_S
            ) -> list[tuple[dict[str, Any] | None, int]]:
    """The daemon's last reads after the trainer's end, waited for as conditions, not a window:
    it has parsed every record replay finds in the run's sources (``log_records_parsed_total``),
    then its rules have run ``SETTLE_EVALUATIONS`` more evaluation intervals (a healthy run's late
    page would show there), and a faulty run's every source has its page. ``limit`` is a deadline."""
    reps = list(pending)
    want = sum(rep["records"] for rep, _rc in reps if rep)
    deadline = time.monotonic() + limit
    caught_up: float | None = None
    while time.monotonic() < deadline:
        _daemon_pages(agent, seen)
        if caught_up is None and _records_parsed(agent) >= want:
            caught_up = time.monotonic()
        if caught_up is not None and time.monotonic() - caught_up >= SETTLE_EVALUATIONS * EVALUATION_INTERVAL_S \
                and (not run.fault or all(_page_of(run, out, s, seen) for s in srcs)):
            break
        time.sleep(0.2)
    _daemon_pages(agent, seen)
    return reps


def _records_parsed(agent: common.AgentProcess) -> float:
    try:
        return sum(common.metric_values(agent.metrics(), "precision_agent_log_records_parsed_total"))
    except (OSError, common.AgentError):
        return 0.0


def run_canary(pinned: bool = False, only: list[str] | None = None, root: Path | None = None,
               timeout: float = 600, jobs: int = 0) -> dict[str, Any]:
    """Every run of every version; ``jobs`` runs at a time (each trainer uses one core, its
    daemon little; 0: one per core, at most 2), each with its own daemon and folder."""
    tmp = None if root is not None else tempfile.TemporaryDirectory(prefix="precision-agent-trainers-")
    root = root or Path(tmp.name)  # type: ignore[union-attr]
    root.mkdir(parents=True, exist_ok=True)
    jobs = jobs or max(1, min(2, os.cpu_count() or 1))
    runs: list[Run] = []
    skipped: list[dict[str, str]] = []
    try:
        for trainer, version in versions(pinned):
            for run in runs_for(trainer, version):
                if only and trainer not in only and run.name not in only:
                    continue
                try:
                    ensure_venv(run, CACHE / f"{run.name}.install.log")
                except Exception as exc:  # noqa: BLE001 - reported, the other trainers go on
                    skipped.append({"trainer": run.name, "why": f"does not install: {exc}"})
                    break
                runs.append(run)
        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(lambda r: run_one(r, root, timeout), runs))
        rows: list[dict[str, Any]] = []
        failed_to_run: set[str] = set()
        for run, got in zip(runs, results):
            if run.trainer == "deepspeed" and any(r.get("exit") for r in got):
                # it installs but cannot run here (its CPU ops build with a C++ compiler and ninja)
                if run.name not in failed_to_run:
                    skipped.append({"trainer": run.name, "why": f"does not run: see {root / run.name / run.variant}"})
                failed_to_run.add(run.name)
        rows = [r for run, got in zip(runs, results) if run.name not in failed_to_run for r in got]
    finally:
        if tmp is not None:
            tmp.cleanup()
    return {"bench": "trainers", "host": common.host_info(), "rows": rows, "skipped": skipped,
            "ok": bool(rows) and all(r["ok"] for r in rows)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pinned", action="store_true", help="the fixtures' versions instead of the newest releases")
    p.add_argument("--only", action="append", help="a trainer (transformers, lightning, deepspeed) or run name")
    p.add_argument("--root", type=Path, default=None, help="keep the runs here (default: a tmp dir, removed)")
    p.add_argument("--jobs", type=int, default=0, help="runs at a time (default: one per core, at most 2)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return run_canary(pinned=args.pinned, only=args.only, root=args.root, jobs=args.jobs)


def report(res: dict[str, Any]) -> str:
    head = ("trainer", "variant", "source", "records", "first non-finite", "page step", "daemon page",
            "s to page", "ok")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in res["rows"]:
        cells = [r.get("trainer"), r.get("variant"), r.get("source"), r.get("records"), r.get("first_nonfinite"),
                 r.get("page_step"), r.get("daemon_page_step"), r.get("seconds_to_page"),
                 "ok" if r.get("ok") else f"FAIL: {r.get('why')}"]
        lines.append(" | ".join("-" if c is None else str(c) for c in cells))
    for s in res["skipped"]:
        lines.append(f"{s['trainer']}: skipped: {s['why']}")
    lines.append("canary: " + ("all sources as expected" if res["ok"] else "FAILED"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trainers", description=__doc__.split("\n")[0])
    p.add_argument("--results-dir", type=Path, default=None)
    add_arguments(p)
    args = p.parse_args(argv)
    res = run_from_args(args)
    path = common.write_result("trainers", res, args.results_dir)
    print(report(res))
    print(f"  (written to {path})")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
