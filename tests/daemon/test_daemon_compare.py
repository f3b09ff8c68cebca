"""The daemon compares each completed dump step with a rerun: another process writes both runs;
a bitwise difference fires DumpNondeterminism naming the first differing op, the table is served
as JSON and written as CSV, digests and comparison counters are exported, and a step whose other
side arrives later is compared once it has settled."""

import json
import subprocess
import sys
import textwrap

from support.agent import AgentProcess
from conftest import wait_for

WRITER = r"""
import sys, numpy as np, pathlib
root, step, ulp = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
d = root / f"step{step}"
d.mkdir(parents=True)
rng = np.random.default_rng(int(step))
for i, op in enumerate(["embed", "attn", "mlp", "head"]):
    w = rng.standard_normal((8, 8)).astype(np.float32)
    if ulp and op == "mlp":
        w[3, 3] = np.nextafter(w[3, 3], np.float32(10))
    np.save(d / f"{i:03d}_{op}.npy", w)
"""


def _write(root, step, ulp=False):
    subprocess.run([sys.executable, "-c", WRITER, str(root), str(step), "1" if ulp else "0"], check=True,
                   timeout=60)


def test_rerun_comparison_fires_on_the_first_differing_op(tmp_path):
    run, rerun, state = tmp_path / "run", tmp_path / "rerun", tmp_path / "state"
    run.mkdir()
    rerun.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text(textwrap.dedent(f"""\
        dump_settle: 0.5s
        watches:
          - path: {run}
            kind: dump
            labels: {{run: r1}}
            compare: {{against: {rerun}, mode: rerun, csv_dir: {tmp_path / 'tables'}}}
            digest: 'npy'
        """))
    agent = AgentProcess(tmp_path / "nolog", state, "--config", str(cfg)).start()
    try:
        _write(rerun, 1)
        _write(run, 1, ulp=True)
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="DumpNondeterminism",
                                      alertstate="firing", run="r1"),
                 timeout=30, what="DumpNondeterminism firing")
        (alert,) = [a for a in agent.alerts() if a["alertname"] == "DumpNondeterminism"]
        assert alert["evidence"]["evidence"]["op"] == "002_mlp.npy" and "op" not in alert["labels"]
        assert alert["evidence"]["evidence"]["differ_bitwise"] == 1
        (res,) = json.loads(agent.get("/api/v1/compare"))["data"]
        assert res["mode"] == "rerun" and res["first_differing_tensor"]["op"] == "002_mlp.npy"
        assert len(res["rows"]) == 4 and res["csv"].startswith(str(tmp_path / "tables"))
        assert agent.metric("precision_agent_dump_compares_total", run="r1", mode="rerun") == 1
        assert agent.metric("precision_agent_dump_compares_diverged_total", run="r1", mode="rerun") == 1
        assert agent.metric("precision_agent_dump_digest_step", run="r1") == 1

        _write(run, 2)     # the rerun has not reached step 2 yet: the step waits
        wait_for(lambda: agent.metric("precision_agent_dump_files_scanned_total") == 8, timeout=30,
                 what="step 2 scanned")
        assert agent.metric("precision_agent_dump_compares_total", run="r1", mode="rerun") == 1
        _write(rerun, 2)
        wait_for(lambda: agent.metric("precision_agent_dump_compares_total", run="r1", mode="rerun") == 2,
                 timeout=30, what="step 2 compared once its rerun side settled")
        assert agent.metric("precision_agent_dump_compares_diverged_total", run="r1", mode="rerun") == 1
        assert agent.metric("precision_agent_dump_digest_step", run="r1") == 2
        assert agent.metric("precision_agent_errors_total", kind="compare") == 0
        assert agent.stop() == 0
    finally:
        agent.kill()
