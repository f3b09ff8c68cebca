"""The daemon on real msprobe dumps (tests/fixtures/msprobe_incidents, written by real msprobe with
its make.py), copied step by step into a watched folder by other processes, one per job and side
by side, as training jobs write them (issue 20):

- a NaN planted at step 3 that stays for 10 steps on 2 ranks: exactly one page, naming the origin
  step, rank and op, with the affected steps in its evidence;
- a restart of a run into the same dump root pages again (a second incident);
- two runs dumping under one watched folder page separately, each with its ``run`` label;
- the healthy runs (AdamW at 1e-5, 1e-4, 3e-4, SGD; statistics and tensor tasks): no alert at all,
  while the frozen run (lr 0) still raises WeightNotChanged;
- the per-rank first non-finite dumps survive an agent restart.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.agent import AgentProcess
from conftest import wait_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "msprobe_incidents"
pytestmark = pytest.mark.skipif(not (FIXTURES / "nan_2ranks").is_dir(), reason="fixtures not generated")

# Copies one msprobe dump root into DEST, one step directory after another in step order, with
# fresh modification times (plain copies, as a job writes them), a step every 0.5 s (the watch's
# dump_settle is 0.3 s: a job writes a step far less often than it settles).
WRITER = r"""
import shutil, sys, time
from pathlib import Path
src, dest = Path(sys.argv[1]), Path(sys.argv[2])
steps = sorted((d for d in src.iterdir() if d.name.startswith("step")), key=lambda d: int(d.name[4:]))
for d in steps:
    shutil.copytree(d, dest / d.name, copy_function=shutil.copyfile, dirs_exist_ok=True)
    time.sleep(0.5)
"""


def _write(*pairs: tuple[Path, Path]) -> None:
    """Each (dump root, destination) copied by its own writer, all at once, as several jobs
    dump side by side; returns when every writer is done."""
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(src), str(dest)]) for src, dest in pairs]
    try:
        for w in writers:
            assert w.wait(timeout=120) == 0, w.args
    finally:
        for w in writers:
            w.kill()


def _units(root: Path) -> int:
    return sum(1 for _ in root.rglob("dump.json"))


def _agent(tmp_path: Path, dumps: Path, extra: str = "") -> AgentProcess:
    cfg = tmp_path / "agent.yml"
    cfg.write_text(f"dump_settle: 0.3s\nwatches:\n  - path: {dumps}\n    kind: dump\n{extra}")
    return AgentProcess(tmp_path / "nolog", tmp_path / "state", "--config", str(cfg)).start()


def _scanned(agent: AgentProcess) -> float:
    return agent.metric("precision_agent_dump_files_scanned_total") or 0.0


def _dump_alerts(agent: AgentProcess, name: str = "DumpNonFinite") -> list[dict]:
    return [a for a in agent.alerts() if a["alertname"] == name]


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file() and p.name != "stack.json")


def test_one_page_per_incident_restart_and_two_runs(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    agent = _agent(tmp_path, dumps)
    try:
        _write((FIXTURES / "nan_2ranks", dumps / "nan_2ranks"), (FIXTURES / "two_runs" / "job_a", dumps / "job_a"),
               (FIXTURES / "two_runs" / "job_b", dumps / "job_b"), (FIXTURES / "restart" / "attempt1", dumps / "job_r"))
        want = sum(_files(FIXTURES / p) for p in ("nan_2ranks", "two_runs", "restart/attempt1"))
        wait_for(lambda: _scanned(agent) >= want, timeout=120, what=f"{want} dump files scanned")
        # directories are scanned as they settle, not in step order: the origin may move to an
        # earlier step scanned later, and the affected steps grow, until every directory is judged
        got = wait_for(lambda: _settled(agent), timeout=30, what="one DumpNonFinite per run, every step judged")
        by_run = {a["labels"]["run"]: a for a in got}
        assert sorted(by_run) == ["job_a", "job_b", "job_r", "nan_2ranks"], by_run.keys()
        nan = by_run["nan_2ranks"]
        ev = nan["evidence"]["evidence"]
        assert "op" not in nan["labels"] and "rank" not in nan["labels"] and nan["labels"]["incident"] == "1"
        assert (nan["evidence"]["step"], ev["origin_rank"]) == (3, "1") and ev["op"].startswith("Torch.matmul."), ev
        assert ev["affected_steps"] == list(range(3, 13)) and ev["affected_steps_total"] == 10, ev
        assert "step 3" in nan["annotations"]["summary"] and "rank 1" in nan["annotations"]["summary"]
        assert all(a["state"] == "firing" for a in got)
        assert agent.metric("precision_agent_alerts", alertname="DumpNonFinite", alertstate="firing",
                            run="nan_2ranks") == 1
        assert (by_run["job_a"]["evidence"]["step"], by_run["job_b"]["evidence"]["step"]) == (2, 3)

        # the restart of job_r from its step-2 checkpoint, into the same dump root: a new page
        _write((FIXTURES / "restart" / "attempt2", dumps / "job_r"))
        second = wait_for(lambda: [a for a in _dump_alerts(agent) if a["labels"]["run"] == "job_r"
                                   and a["labels"]["incident"] == "2"
                                   and a["evidence"]["evidence"]["affected_steps"] == [4, 5]],
                          timeout=60, what="the restart's incident, both its steps judged")
        assert second[0]["evidence"]["step"] == 4 and second[0]["state"] == "firing"
        assert not [a for a in _dump_alerts(agent) if a["labels"]["run"] == "job_r"
                    and a["labels"]["incident"] == "1" and a["state"] == "firing"]   # the attempt before resolved
        assert len([a for a in _dump_alerts(agent) if a["state"] == "firing"]) == 4
        origins = _origins(agent)
        assert origins[("nan_2ranks", "1")] == 3 and origins[("nan_2ranks", "0")] == 3
        assert agent.stop() == 0
    finally:
        agent.kill()
    again = _agent(tmp_path, dumps)     # the per-rank first non-finite dumps come back from the store
    try:
        wait_for(lambda: _origins(again).get(("nan_2ranks", "1")) == 3, timeout=30, what="origins after restart")
        assert _scanned(again) == 0
    finally:
        again.stop()


def _settled(agent: AgentProcess) -> list[dict] | None:
    got = _dump_alerts(agent)
    steps = {a["labels"]["run"]: a["evidence"]["evidence"]["affected_steps"] for a in got}
    want = {"nan_2ranks": list(range(3, 13)), "job_a": [2, 3, 4], "job_b": [3, 4], "job_r": [3, 4, 5]}
    return got if len(got) == 4 and steps == want else None


def _origins(agent: AgentProcess) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(agent.get("/metrics")):
        if fam.name == "precision_agent_dump_first_nonfinite_step":
            for s in fam.samples:
                out[(s.labels.get("run", ""), s.labels.get("rank", ""))] = s.value
    return out


def test_healthy_runs_raise_nothing_and_a_frozen_run_still_does(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    agent = _agent(tmp_path, dumps)
    try:
        healthy = sorted(p for p in (FIXTURES / "healthy").iterdir() if p.is_dir())
        assert len(healthy) >= 5
        _write(*((run, dumps / run.name) for run in healthy), (FIXTURES / "frozen" / "lr0", dumps / "lr0"))
        want = sum(_files(p) for p in healthy) + _files(FIXTURES / "frozen" / "lr0")
        wait_for(lambda: _scanned(agent) >= want, timeout=180, what=f"{want} dump files scanned")
        frozen = wait_for(lambda: [a for a in agent.alerts() if a["labels"].get("run") == "lr0"], timeout=30,
                          what="the frozen run's alert")
        assert {a["alertname"] for a in frozen} == {"WeightNotChanged"}, frozen
        others = [(a["alertname"], a["labels"]) for a in agent.alerts() if a["labels"].get("run") != "lr0"]
        assert others == [], others
        assert agent.metric("precision_agent_errors_total", kind="scan") in (None, 0.0)
    finally:
        agent.stop()
