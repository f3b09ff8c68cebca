"""The daemon and fusion (issue 11): it picks up the job's fusion report and executed graph where
the job writes them (its dump tree, and the places a dump watch's ``fusion_files`` names), keeps
the latest per job, and a dump fault at an op fusion passes made fires ``FusionSuspected`` with the
passes and the switch file; a live comparison of a fusion-on run against a fusion-off run names the
first diverging module and the fused API inside it. Another process writes every file; the real
daemon runs as a subprocess; results are read from /metrics and /api/v1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.agent import AgentProcess
from conftest import wait_for

TESTS = Path(__file__).resolve().parents[1]
FIX = TESTS / "fixtures" / "msprobe_fusion"

JOB = r"""
import json, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from support import dumps as W
from support.dumps import ge_text
workdir, dumps, step, fused, passes = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6].split(",")
compiles = sys.argv[7] == "1"
# the graph compiler: the executed graph and the fusion report in the job's working directory
ops = [{"name": "mm_1", "type": "MatMul", "attrs": {"_datadump_original_op_names": ["mm_1"]}, "outputs": [{}]},
       {"name": fused, "type": "FusedOp", "attrs": {"pass_name": passes, "_datadump_original_op_names": ["a_1", "b_1"]},
        "outputs": [{}]}]
if compiles:
    (workdir / f"ge_proto_0000000{step}_Build.txt").write_text(ge_text([("g", ops)]))
    (workdir / "fusion_result.json").write_text(json.dumps({
        "graph_fusion": {passes[0]: {"match_times": "1", "effect_times": "1"}},
        "ub_fusion": {p: {"match_times": "1", "effect_times": "1"} for p in passes[1:]}}))
# then the dumps of that step: the fused op turns finite inputs into a NaN
d = dumps / f"step{step}"
d.mkdir(parents=True)
good = np.ones((2, 3), np.float32)
bad = good.copy()
bad[0, 1] = np.nan
for i, (op_type, name, ins, outs) in enumerate([("MatMul", "mm_1", [good], [good]), ("FusedOp", fused, [good], [bad])]):
    W.write_cann_dump(str(d / W.dump_name(op_type, name, i + 1, 0, 1_700_000_000_000 + 10 * step + i)),
                      inputs=[W.tensor(a) for a in ins], outputs=[W.tensor(a) for a in outs])
"""


def _job(workdir: Path, dumps: Path, step: int, fused: str, passes: str, compiles: bool = True) -> None:
    """The job: compile (graph + report), then write the step's dumps."""
    subprocess.run([sys.executable, "-c", JOB, str(TESTS), str(workdir), str(dumps), str(step), fused, passes,
                    "1" if compiles else "0"], check=True, timeout=60)


def _daemon(tmp_path: Path, watch: dict) -> AgentProcess:
    """The daemon with one dump watch (settle 0.5 s)."""
    cfg = tmp_path / "agent.yml"
    cfg.write_text(json.dumps({"dump_settle": "0.5s", "watches": [{"kind": "dump", **watch}]}))
    return AgentProcess(tmp_path / "nolog", tmp_path / "state", "--config", str(cfg)).start()


def _fusion_alert(agent: AgentProcess, op: str) -> dict:
    (alert,) = [a for a in agent.alerts() if a["alertname"] == "FusionSuspected" and a["labels"].get("op") == op]
    return alert


def test_a_dump_fault_at_a_fused_graph_op_fires_fusion_suspected_with_the_passes(tmp_path):
    dumps, workdir = tmp_path / "dumps", tmp_path / "job"
    dumps.mkdir()
    workdir.mkdir()
    agent = _daemon(tmp_path, {"path": str(dumps), "labels": {"job": "llama"}, "fusion_files": [str(workdir)]})
    try:
        _job(workdir, dumps, 1, "add_layernorm_fused", "AddLayerNormFusionPass,TbeEltwiseFusionPass")
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="FusionSuspected", alertstate="firing",
                                      op="add_layernorm_fused", job="llama"), timeout=30, what="FusionSuspected")
        ev = _fusion_alert(agent, "add_layernorm_fused")["evidence"]["evidence"]
        assert ev["kind"] == "graph_pass" and ev["found_by"] == "dump_nonfinite"
        assert ev["passes"] == ["AddLayerNormFusionPass", "TbeEltwiseFusionPass"]
        assert ev["switch_cfg"] == {"Switch": {"GraphFusion": {"AddLayerNormFusionPass": "off"},
                                               "UBFusion": {"TbeEltwiseFusionPass": "off"}}}
        summary = _fusion_alert(agent, "add_layernorm_fused")["annotations"]["summary"]
        assert "AddLayerNormFusionPass, TbeEltwiseFusionPass" in summary

        # the job compiles again: the latest graph and report are the ones used for the next step
        _job(workdir, dumps, 2, "matmul_bias_fused", "MatMulBiasAddFusionPass")
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="FusionSuspected", alertstate="firing",
                                      op="matmul_bias_fused", job="llama"), timeout=30, what="the second FusionSuspected")
        ev2 = _fusion_alert(agent, "matmul_bias_fused")["evidence"]["evidence"]
        assert ev2["passes"] == ["MatMulBiasAddFusionPass"]
        assert ev2["switch_cfg"]["Switch"]["GraphFusion"] == {"MatMulBiasAddFusionPass": "off"}
        assert agent.metric("precision_agent_errors_total", kind="scan") == 0
        assert agent.stop() == 0
    finally:
        agent.kill()


def test_fusion_files_in_the_dump_tree_and_a_bad_one_counted_once(tmp_path):
    """No fusion_files option: the files are found in the watched dump tree. A report that cannot
    be read is one scan error, not one per scan."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "graphs").mkdir()
    agent = _daemon(tmp_path, {"path": str(dumps)})
    try:
        _job(dumps / "graphs", dumps, 1, "conv_bn_fused", "ConvBatchnormFusionPass")
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="FusionSuspected", alertstate="firing",
                                      op="conv_bn_fused"), timeout=30, what="FusionSuspected from the dump tree")
        assert _fusion_alert(agent, "conv_bn_fused")["evidence"]["evidence"]["passes"] == ["ConvBatchnormFusionPass"]
        subprocess.run([sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write('{\"graph_fusion\": ')",
                        str(dumps / "graphs" / "fusion_result.json")], check=True, timeout=30)
        for step in (2, 3):   # two more steps with the broken report: one error, not two
            op = f"conv_bn_fused_{step}"
            _job(dumps / "graphs", dumps, step, op, "ConvBatchnormFusionPass", compiles=False)
            wait_for(lambda: any(a["alertname"] == "DumpNonFinite" and a["evidence"]["evidence"]["latest_step"] == step
                                 for a in agent.alerts()), timeout=30, what=f"step {step} scanned")   # one incident
        assert agent.metric("precision_agent_errors_total", kind="scan") == 1
        assert "fusion_result.json" in agent.stderr() and "ends early" in agent.stderr()
        assert agent.stop() == 0
    finally:
        agent.kill()


def test_a_live_comparison_across_fusion_names_the_module_and_the_fused_api(tmp_path):
    run, off = tmp_path / "on", tmp_path / "off"
    run.mkdir()
    off.mkdir()
    agent = _daemon(tmp_path, {"path": str(run), "labels": {"job": "tiny", "fusion": "on"},
                               "compare": {"against": str(off)}})
    try:
        # the fusion-off run, then the fusion-on run with a fault inside scaled_dot_product_attention
        subprocess.run(["cp", "-r", str(FIX / "off" / "step0"), str(off)], check=True, timeout=30)
        subprocess.run(["cp", "-r", str(FIX / "on_fault" / "step0"), str(run)], check=True, timeout=30)
        module = "Module.attn.Attention.forward.0"
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="FusionSuspected", alertstate="firing",
                                      op=module, job="tiny"), timeout=30, what="FusionSuspected on the module")
        ev = _fusion_alert(agent, module)["evidence"]["evidence"]
        assert ev["api"] == "scaled_dot_product_attention" and ev["found_by"] == "dump_divergence"
        assert ev["fused_ops"] == ["Functional.scaled_dot_product_attention.0.forward"]
        (div,) = [a for a in agent.alerts() if a["alertname"] == "DumpDivergence"]
        assert div["evidence"]["evidence"]["op"] == module and div["labels"]["job"] == "tiny"
        (res,) = json.loads(agent.get("/api/v1/compare"))["data"]
        assert res["across_fusion"]["level"] == "module" and res["unmatched"] == []
        assert res["fusion_suspect"]["fused_ops"] == ["Functional.scaled_dot_product_attention.0.forward"]
        assert agent.metric("precision_agent_errors_total", kind="compare") == 0
        assert agent.stop() == 0
    finally:
        agent.kill()


def test_fusion_suspected_with_the_passes_reaches_a_real_alertmanager(tmp_path):
    from support.prom import get_json, running_alertmanager
    dumps, workdir = tmp_path / "dumps", tmp_path / "job"
    dumps.mkdir()
    workdir.mkdir()
    config = {"route": {"receiver": "null", "group_wait": "0s"}, "receivers": [{"name": "null"}]}
    (tmp_path / "am").mkdir()
    with running_alertmanager(config, tmp_path / "am") as url:
        cfg = tmp_path / "agent.yml"
        cfg.write_text(json.dumps({"dump_settle": "0.5s", "alertmanager": {"urls": [url], "resend_interval": "1m"},
                                   "watches": [{"path": str(dumps), "kind": "dump", "labels": {"job": "llama"},
                                                "fusion_files": [str(workdir)]}]}))
        agent = AgentProcess(tmp_path / "nolog", tmp_path / "state", "--config", str(cfg)).start()
        try:
            _job(workdir, dumps, 1, "add_layernorm_fused", "AddLayerNormFusionPass,TbeEltwiseFusionPass")
            (a,) = wait_for(lambda: [a for a in get_json(f"{url}/api/v2/alerts")
                                     if a["labels"]["alertname"] == "FusionSuspected"], 30,
                            what="FusionSuspected in Alertmanager")
            assert a["labels"]["op"] == "add_layernorm_fused" and a["labels"]["severity"] == "ticket"
            assert "AddLayerNormFusionPass, TbeEltwiseFusionPass" in a["annotations"]["summary"]
            assert agent.stop() == 0
        finally:
            agent.kill()


def test_a_broken_user_catalogue_is_counted_once_as_a_config_error(tmp_path):
    """The daemon with $PRECISION_AGENT_FUSED_APIS naming a broken file: the scans of two steps whose
    first bad op is a fused API count one `config` error between them, no silent switch-off."""
    bad = tmp_path / "apis.yml"
    bad.write_text("fused_apis: 3\n")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text(json.dumps({"dump_settle": "0.5s", "watches": [{"kind": "dump", "path": str(dumps)}]}))
    agent = AgentProcess(tmp_path / "nolog", tmp_path / "state", "--config", str(cfg)).start(
        env={"PRECISION_AGENT_FUSED_APIS": str(bad)})
    try:
        subprocess.run(["cp", "-r", str(FIX / "on_nan" / "step0"), str(dumps / "step0")], check=True, timeout=60)
        wait_for(lambda: agent.metric("precision_agent_errors_total", kind="config") == 1, timeout=30,
                 what="the catalogue's config error")
        scanned = agent.metric("precision_agent_dump_files_scanned_total")
        subprocess.run(["cp", "-r", str(FIX / "on_nan" / "step0"), str(dumps / "step1")], check=True, timeout=60)
        wait_for(lambda: agent.metric("precision_agent_dump_files_scanned_total") == 2 * scanned, timeout=30,
                 what="the second step scanned")
        assert agent.metric("precision_agent_errors_total", kind="config") == 1
        assert agent.metric("precision_agent_errors_total", kind="scan") == 0
        assert not [a for a in agent.alerts() if a["alertname"] == "FusionSuspected"]
        assert "fusion catalogue" in agent.stderr()
    finally:
        agent.stop()


OVERFLOW_JOB = r"""
import json, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from support import dumps as W
from support.dumps import ge_text
workdir, dumps = Path(sys.argv[2]), Path(sys.argv[3])
ops = [{"name": "fz", "type": "FusedOp", "attrs": {"pass_name": ["MatMulBiasAddFusionPass"],
        "_datadump_original_op_names": ["mm_1", "bias_1"]}, "outputs": [{}]}]
(workdir / "ge_proto_00000001_Build.txt").write_text(ge_text([("g", ops)]))
(workdir / "fusion_result.json").write_text(json.dumps(
    {"graph_fusion": {"MatMulBiasAddFusionPass": {"match_times": "1", "effect_times": "1"}}}))
d = dumps / "step1"
d.mkdir(parents=True)
one, sat = np.ones((2, 3), np.float16), np.array([65504.0, 1.0, 2.0], np.float16)   # saturates, stays finite
ts = 1_700_000_000_000
for i, (t, n, ins, outs) in enumerate([("MatMul", "mm_0", [one], [one]), ("FusedOp", "fz", [one], [sat])]):
    W.write_cann_dump(str(d / W.dump_name(t, n, i + 1, 0, ts + i)), inputs=[W.tensor(a) for a in ins],
                      outputs=[W.tensor(a) for a in outs])
W.write_opdebug(str(d / W.opdebug_name(9, 0, ts + 5)), W.new_record(0, [1, 0, 2, 0, 65535, 65535, 0, 0, 0, 0], [0x20]))
"""


def test_an_opdebug_overflow_at_a_fused_op_fires_fusion_suspected_in_the_daemon(tmp_path):
    """No op turned NaN/Inf; Opdebug says the op two passes made overflowed: FusionSuspected, found by
    dump_overflow, with the switch file in its description (what Alertmanager's receivers see)."""
    dumps, workdir = tmp_path / "dumps", tmp_path / "job"
    dumps.mkdir()
    workdir.mkdir()
    agent = _daemon(tmp_path, {"path": str(dumps), "labels": {"job": "llama"}, "fusion_files": [str(workdir)]})
    try:
        subprocess.run([sys.executable, "-c", OVERFLOW_JOB, str(TESTS), str(workdir), str(dumps)], check=True,
                       timeout=60)
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="FusionSuspected", alertstate="firing",
                                      op="fz", job="llama"), timeout=30, what="FusionSuspected on an overflow")
        alert = _fusion_alert(agent, "fz")
        assert alert["evidence"]["evidence"]["found_by"] == "dump_overflow"
        assert ('The fusion_switch.cfg that turns off exactly it: {"Switch": {"GraphFusion": '
                '{"MatMulBiasAddFusionPass": "off"}, "UBFusion": {}}}') in alert["annotations"]["description"]
        (ovf,) = [a for a in agent.alerts() if a["alertname"] == "DumpOverflow"]
        assert ovf["evidence"]["evidence"]["op"] == "fz" and ovf["state"] == "firing"
    finally:
        agent.stop()
