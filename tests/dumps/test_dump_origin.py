"""The dump side of a non-finite incident's origin (agent/dumps/origins.py): per rank, the step,
time and first bad op of its first non-finite dump, one series per rank.

- the bookkeeping: a lower step replaces the op (one series per rank), a later one never does, a
  clean or bad rerun written afterwards (same or lower step) starts a new attempt;
- the real daemon on a dump watch labelled with the run: another process writes msprobe dumps of
  two ranks, /metrics carries each rank's first bad op and step, and a clean rerun drops the rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from support.agent import AgentProcess
from conftest import wait_for

from precision_agent.dumps.origins import DumpOrigins
from precision_agent.exporters.dumps import origin_metrics

LINEAR = "Functional.linear.0.forward"


def _result(rank: int, step: int, bad_op: str | None) -> dict:
    tensors = [{"name": "Functional.linear.0.forward", "io": "input", "index": 0, "rank": rank, "step": step,
                "nan": 0, "pos_inf": 0, "neg_inf": 0},
               {"name": bad_op or "Torch.relu.0.forward", "io": "output", "index": 0, "rank": rank, "step": step,
                "nan": 1 if bad_op else 0, "pos_inf": 0, "neg_inf": 0}]
    first = {"step": step, "rank": rank, "op": bad_op, "tensor": "output[0]"} if bad_op else None
    return {"tensors": tensors, "first_nonfinite": first}


def _series(book: DumpOrigins) -> dict[tuple[str, str], tuple[float, str]]:
    out = {}
    for fam in origin_metrics(book.snapshot()):
        if fam.name == "precision_agent_dump_first_nonfinite_step":
            for s in fam.samples:
                out[(s.labels["run"], s.labels["rank"])] = (s.value, s.labels["op"])
    return out


def test_one_series_per_rank_lowest_step_wins() -> None:
    book = DumpOrigins()
    run = {"run": "r1"}
    book.observe(_result(0, 12, "Functional.gelu.3.forward"), run, "/d/step12/rank0", 100.0)
    book.observe(_result(0, 14, "Functional.add.1.forward"), run, "/d/step14/rank0", 101.0)  # later: copy
    assert _series(book) == {("r1", "0"): (12, "Functional.gelu.3.forward")}
    book.observe(_result(0, 10, LINEAR), run, "/d/step10/rank0", 99.0)       # scanned late, written earlier
    assert _series(book) == {("r1", "0"): (10, LINEAR)}                      # the op moved: still one series
    book.observe(_result(0, 11, None), run, "/d/step11/rank0", 99.5)         # a clean later step changes nothing
    book.observe(_result(1, 10, None), run, "/d/step10/rank1", 99.0)         # a clean rank exports nothing
    book.observe(_result(0, 10, "Torch.mul.0.forward"), {"run": "r2"}, "/e/step10/rank0", 99.0)
    assert _series(book) == {("r1", "0"): (10, LINEAR), ("r2", "0"): (10, "Torch.mul.0.forward")}
    fams = {f.name: f for f in origin_metrics(book.snapshot())}
    (t,) = [s for s in fams["precision_agent_dump_first_nonfinite_timestamp_seconds"].samples
            if s.labels["run"] == "r1"]
    assert t.value == 99.0 and t.labels["op"] == LINEAR


def test_a_rerun_starts_a_new_attempt() -> None:
    book = DumpOrigins()
    run = {"run": "r1"}
    book.observe(_result(0, 10, LINEAR), run, "/d/step10/rank0", 100.0)
    book.observe(_result(0, 8, None), run, "/d/step8/rank0", 50.0)           # an older clean dump: kept
    assert _series(book) == {("r1", "0"): (10, LINEAR)}
    book.observe(_result(0, 8, None), run, "/d/step8/rank0", 200.0)          # rerun from step 8, clean
    assert _series(book) == {}
    book.observe(_result(0, 10, LINEAR), run, "/d/step10/rank0", 300.0)
    book.observe(_result(0, 9, "Torch.mul.0.forward"), run, "/d/step9/rank0", 400.0)  # bad rerun: replaces
    assert _series(book) == {("r1", "0"): (9, "Torch.mul.0.forward")}
    book.observe(_result(0, 9, None), run, "/d/step9/rank0", 400.0)          # the same directory, re-scanned clean
    assert _series(book) == {}


def test_bounded() -> None:
    book = DumpOrigins(cap=4)
    for rank in range(10):
        book.observe(_result(rank, 1, LINEAR), {"run": "r"}, f"/d/step1/rank{rank}", 1.0)
    assert sorted(r for _, r in _series(book)) == ["6", "7", "8", "9"]


def test_records_survive_a_restart_and_bad_rows_are_skipped() -> None:
    book = DumpOrigins()
    assert book.observe(_result(1, 3, LINEAR), {"run": "r1"}, "/d/step3/rank1", 100.0) is True
    assert book.observe(_result(1, 5, "Torch.mul.0.forward"), {"run": "r1"}, "/d/step5/rank1", 101.0) is False
    again = DumpOrigins()
    rows = book.rows()
    assert again.restore(rows + [["not", "a", "row"], [[["run", "x"]], "3", 1.0, "op", "/u"]]) == 2
    assert _series(again) == {("r1", "1"): (3, LINEAR)}


def test_the_state_store_keeps_them(tmp_path: Path) -> None:
    from precision_agent.store.state import StateStore
    book = DumpOrigins()
    book.observe(_result(0, 7, LINEAR), {"run": "r1"}, "/d/step7/rank0", 100.0)
    store = StateStore(tmp_path)
    store.save_dump_origins(book.rows())
    store.close()
    again = DumpOrigins()
    assert again.restore(StateStore(tmp_path).load_dump_origins()) == 0
    assert _series(again) == {("r1", "0"): (7, LINEAR)}


WRITER = r"""
import sys, numpy as np
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from support.dumps import write_msprobe
root, what = Path(sys.argv[1]), sys.argv[3]
x = np.ones((2, 3), np.float32)
y = x @ x.T
bad = y.copy(); bad[0, 1] = np.nan
def net(step, rank, nan):
    out = bad if nan else y
    write_msprobe(root, [("Functional.linear.0.forward", {"input_args": [x, x.T.copy()], "output": [out]}),
                         ("Torch.relu.0.forward", {"input_args": [out], "output": [out]})], step=step, rank=rank)
if what == "incident":
    net(3, "rank1", True)     # rank 1 goes first
    net(5, "rank0", True)     # rank 0 two steps later
else:
    net(2, "rank1", False)    # rank 1 restarted from step 2, clean
"""


def _dump_origins(agent: AgentProcess) -> dict[str, tuple[float, str]]:
    out = {}
    for fam in text_string_to_metric_families(agent.get("/metrics")):
        if fam.name == "precision_agent_dump_first_nonfinite_step":
            for s in fam.samples:
                assert s.labels["run"] == "r1", s
                out[s.labels["rank"]] = (s.value, s.labels["op"])
    return out


def test_daemon_exports_each_ranks_first_bad_op(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text(f"dump_settle: 0.5s\nwatches:\n  - path: {dumps}\n    kind: dump\n    labels: {{run: r1}}\n")
    agent = AgentProcess(tmp_path / "nolog", tmp_path / "state", "--config", str(cfg)).start()
    try:
        assert "# TYPE precision_agent_dump_first_nonfinite_step gauge" in agent.get("/metrics")
        subprocess.run([sys.executable, "-c", WRITER, str(dumps), os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "incident"],
                       check=True, timeout=60)
        got = wait_for(lambda: len(_dump_origins(agent)) == 2 and _dump_origins(agent), timeout=30,
                       what="both ranks' first non-finite dumps in /metrics")
        assert got == {"1": (3, LINEAR), "0": (5, LINEAR)}, got
        subprocess.run([sys.executable, "-c", WRITER, str(dumps), os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rerun"],
                       check=True, timeout=60)
        wait_for(lambda: _dump_origins(agent) == {"0": (5, LINEAR)}, timeout=30,
                 what="rank 1's record dropped after its clean rerun")
    finally:
        agent.stop()
