"""The daemon's dump scan with `limits.scan_jobs` (issue 21): another process writes a step of
dumps, corrupt files among them; with 3 scan jobs the daemon pages on the same first bad op, counts
the same files and the same unreadable ones as the default of one job; the scheduler hands its
jobs the scan thread's confinement."""

import json
import subprocess
import sys
import threading
from contextlib import contextmanager

import numpy as np

from support.agent import AgentProcess
from conftest import wait_for

WRITER = r"""
import sys, numpy as np, pathlib
d = pathlib.Path(sys.argv[1]) / "step3"
d.mkdir(parents=True)
rng = np.random.default_rng(3)
for i in range(8):
    x = rng.standard_normal(300_000).astype(np.float32)
    if i >= 5:
        x[17 * i] = np.nan            # 005 is the first non-finite output, the rest propagate
    np.save(d / f"{i:03d}_op{i}.npy", x)
(d / "004b_cut.npy").write_bytes((d / "004_op4.npy").read_bytes()[:5000])   # truncated
(d / "004c_junk.npy").write_bytes(b"not a dump")
"""


def _run_daemon(tmp_path, jobs: int) -> tuple[dict, float, float]:
    base = tmp_path / f"jobs{jobs}"
    dumps, state = base / "dumps", base / "state"
    dumps.mkdir(parents=True)
    cfg = base / "agent.yml"
    cfg.write_text(f"dump_settle: 0.5s\nlimits:\n  scan_jobs: {jobs}\n")
    agent = AgentProcess(base / "nolog", state, "--config", str(cfg), "--watch", f"dump:{dumps}").start()
    try:
        subprocess.run([sys.executable, "-c", WRITER, str(dumps)], check=True, timeout=60)
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="DumpNonFinite", alertstate="firing"),
                 timeout=60, what="DumpNonFinite firing")
        wait_for(lambda: agent.metric("precision_agent_dump_files_scanned_total") == 10, timeout=30,
                 what="the step's files counted")
        (alert,) = [a for a in agent.alerts() if a["alertname"] == "DumpNonFinite"]
        unreadable = sum(agent.metric("precision_agent_dump_unreadable_total", cause=c) or 0
                         for c in ("io", "truncated", "limit", "invalid"))
        scanned = agent.metric("precision_agent_dump_files_scanned_total")
        assert agent.stop() == 0
        evidence = json.loads(json.dumps(alert["evidence"]["evidence"]).replace(str(base), "BASE"))
        evidence.pop("written")   # when the writer wrote the dump: another moment in each run
        evidence["suspect_evidence"].pop("judged_at")   # when the suspect verdict was made: likewise
        return evidence, unreadable, scanned
    finally:
        agent.kill()


def test_daemon_scan_jobs_change_nothing_but_the_cores_used(tmp_path):
    one = _run_daemon(tmp_path, 1)
    three = _run_daemon(tmp_path, 3)
    assert one[0]["op"] == "005_op5.npy" and one[1] == 2
    assert three == one


def test_scheduler_runs_its_jobs_under_its_guard(tmp_path):
    from precision_agent.dumps.schedule import DumpScheduler
    step = tmp_path / "step1"
    step.mkdir()
    for i in range(5):
        np.save(step / f"t{i}.npy", np.full(1000, i, np.float32))
    entered = set()

    @contextmanager
    def guard():
        entered.add(threading.current_thread().name)
        yield

    sched = DumpScheduler(settle=0.0, queue_size=4, scanned={}, jobs=2)
    sched.guard = guard
    sched.queue.put_nowait((str(step), (5, 0, 0)))
    sched.start()
    try:
        wait_for(lambda: sched.inbox, what="scan result")
        (r,) = sched.drain()
    finally:
        sched.stop()
    assert r.error is None and len(r.result["tensors"]) == 5 and r.files_read == 5
    assert "dump-scan" in entered and {n for n in entered if n.startswith("scan-job-")}


# a read stuck in the kernel (a hung network mount), on one job: no progress while HANG exists
_STUCK = """
import os, time
import precision_agent.dumps.scan as scan
_real = scan.statistics
def statistics(t, *args, **kwargs):
    if os.path.basename(t.path) == "b.npy":
        while os.path.exists(os.path.join(os.path.dirname(t.path), "HANG")):
            time.sleep(0.05)
    return _real(t, *args, **kwargs)
scan.statistics = statistics
"""


def test_a_job_stuck_on_one_file_is_seen_and_other_trees_go_on(tmp_path):
    """With 2 jobs, the other job finishes its files, then the scan thread waits for the stuck one:
    its heartbeat stops, the worker counts as stalled, a fresh scan thread takes the other trees."""
    import os
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_STUCK)
    dumps, state = tmp_path / "dumps", tmp_path / "state"
    dumps.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text("dump_settle: 0.3s\nlimits:\n  scan_jobs: 2\n  worker_stall_timeout: 1s\n")
    agent = AgentProcess(tmp_path / "nolog", state, "--config", str(cfg), "--watch", f"dump:{dumps}")
    agent.start({"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])})
    try:
        stuck = dumps / "stuck"
        stuck.mkdir()
        (stuck / "HANG").write_text("")
        for name in ("a.npy", "b.npy", "c.npy", "d.npy"):
            np.save(stuck / name, np.zeros(8, np.float32))
        wait_for(lambda: not agent.ready(), 30, what="/-/ready 503 while a job is stuck")
        wait_for(lambda: agent.metric("precision_agent_worker_stalled", worker="dump-scan") == 1, 30,
                 what="the scan worker counted as stalled")
        other = dumps / "other"
        other.mkdir()
        np.save(other / "y.npy", np.array([1.0, np.nan], np.float32))
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="DumpNonFinite", alertstate="firing"),
                 timeout=30, what="DumpNonFinite from another tree")
        (stuck / "HANG").unlink()
        wait_for(agent.ready, 30, what="ready again once the stuck job moved on")
        wait_for(lambda: agent.metric("precision_agent_worker_stalled", worker="dump-scan") == 0, 30,
                 what="the scan worker no longer stalled")
    finally:
        rc = agent.stop(timeout=20)
    assert rc == 0
