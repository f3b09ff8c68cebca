"""Fusion suspicion on the first bad op (issue 11, part 2): a fault that starts inside a fused API
(msprobe dumps, written here in msprobe's tensor-mode layout) is named with ``fusion_suspect`` by
``scan`` and ``compare``; a graph op made by a pass names the pass; clean runs name nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import corpus_path
from precision_agent.fusion.suspect import CatalogueError, catalogue, fused_api, suspect
from support.fusion import WRITER
from support.fusion import attention_calls as run_of
from support.fusion import write_msprobe_calls as write_msprobe


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "precision_agent", *map(str, args), "--json"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout)


def test_a_nan_born_inside_a_fused_api_is_named(tmp_path):
    write_msprobe(tmp_path, run_of("nan"))
    _, r = cli("scan", tmp_path)
    assert r["first_nonfinite"]["op"] == "NPU.npu_fusion_attention.0.forward"
    s = r["fusion_suspect"]
    assert s["kind"] == "fused_api" and s["api"] == "npu_fusion_attention" and "attention" in s["advice"]
    assert s["op"] == "NPU.npu_fusion_attention.0.forward" and s["passes"] == [] and s["switch_cfg"] is None
    text = subprocess.run([sys.executable, "-m", "precision_agent", "scan", str(tmp_path)],
                          capture_output=True, text=True, timeout=120).stdout
    assert "fusion suspect: NPU.npu_fusion_attention.0.forward is a fused npu_fusion_attention" in text


def test_a_clean_run_names_no_suspect(tmp_path):
    write_msprobe(tmp_path / "a", run_of(None))
    _, r = cli("scan", tmp_path / "a")
    assert r["first_nonfinite"] is None and r["fusion_suspect"] is None
    write_msprobe(tmp_path / "b", run_of(None))
    _, c = cli("compare", tmp_path / "a", tmp_path / "b")
    assert c["fusion_suspect"] is None


def test_compare_names_the_fused_api_that_lost_precision(tmp_path):
    write_msprobe(tmp_path / "bench", run_of(None))
    write_msprobe(tmp_path / "target", run_of("drift"))
    rc, c = cli("compare", tmp_path / "bench", tmp_path / "target")
    assert rc == 1 and c["first_diverging_op"]["op"] == "NPU.npu_fusion_attention.0.forward"
    assert c["fusion_suspect"]["api"] == "npu_fusion_attention"


@pytest.mark.parametrize("op, api", [
    ("Torch.scaled_dot_product_attention.3.backward", "scaled_dot_product_attention"),
    ("NPU.npu_add_rms_norm.0.forward", "npu_rms_norm"),
    ("NPU.npu_rotary_mul.7.forward", "npu_rotary_mul"),
    ("NPU.npu_swiglu.1.forward", "npu_swiglu"),
    ("Module.layers.3.self_attention.core_attention.FlashSelfAttention.forward.0", "flash_attn"),
    ("Module.layers.0.input_layernorm.MixedFusedLayerNorm.forward.0", "fused_layer_norm"),
    ("Module.layers.0.attn.FusedScaleMaskSoftmax.forward.0", "scaled_masked_softmax"),
])
def test_catalogue_names(op, api):
    assert fused_api(op).api == api


@pytest.mark.parametrize("op", ["Functional.linear.0.forward", "Torch.softmax.1.forward", "Tensor.__add__.2.forward",
                                "Module.layers.0.mlp.fc1.Linear.forward.0", "relu_1"])
def test_unfused_ops_are_no_suspects(op):
    assert suspect(op) is None


def test_users_extend_the_catalogue(tmp_path):
    extra = tmp_path / "mine.yml"
    extra.write_text("fused_apis:\n  - api: my_fused_mlp\n    names: [my_fused_mlp]\n    unfused: use MLP\n")
    apis = catalogue(str(extra))
    assert fused_api("Torch.my_fused_mlp.0.forward", apis).api == "my_fused_mlp"
    assert fused_api("NPU.npu_swiglu.0.forward", apis).api == "npu_swiglu"  # the shipped ones stay
    bad = tmp_path / "bad.yml"
    bad.write_text("fused_apis: [{api: x}]\n")
    with pytest.raises(CatalogueError, match="names"):
        catalogue(str(bad))


@pytest.mark.corpus
def test_a_graph_op_made_by_a_pass_names_the_pass_and_its_switch_file():
    from precision_agent.fusion.graph import read_graph_file
    from precision_agent.fusion.report import FusionReport, GraphPasses, PassCount
    g = read_graph_file(corpus_path("ascend", "atc_om_graph__msquickcmp_model.json"))
    report = FusionReport(["r.json"], [GraphPasses("0_0", {"ConstToAttrStridedSliceV2Fusion": PassCount(1, 1)}, {})],
                          {"ConstToAttrStridedSliceV2Fusion": PassCount(1, 1)}, {})
    s = suspect("Slice_1218", g, report).to_json()
    assert s["kind"] == "graph_pass" and s["passes"] == ["ConstToAttrStridedSliceV2Fusion"]
    assert s["switch_cfg"] == {"Switch": {"GraphFusion": {"ConstToAttrStridedSliceV2Fusion": "off"}, "UBFusion": {}}}


def test_the_daemon_fires_fusion_suspected_from_a_dump_watch(tmp_path):
    """Dump watch -> scan -> first bad op inside npu_fusion_attention -> FusionSuspected on /metrics,
    with the API and how to run it unfused in the alert."""
    from pathlib import Path
    from support.agent import AgentProcess
    from conftest import wait_for
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text("dump_settle: 0.5s\n")
    agent = AgentProcess(tmp_path / "nolog", tmp_path / "state", "--config", str(cfg),
                         "--watch", f"dump:{dumps}").start()
    try:
        subprocess.run([sys.executable, "-c", WRITER, str(dumps), str(Path(__file__).resolve().parents[1])], check=True, timeout=60)
        op = "NPU.npu_fusion_attention.0.forward"
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="FusionSuspected", alertstate="firing",
                                      op=op, severity="ticket"), timeout=30, what="FusionSuspected firing")
        (alert,) = [a for a in agent.alerts() if a["alertname"] == "FusionSuspected"]
        ev = alert["evidence"]["evidence"]
        assert ev["api"] == "npu_fusion_attention" and ev["kind"] == "fused_api" and ev["found_by"] == "dump_nonfinite"
        assert alert["annotations"]["summary"].startswith(f"{op} is fused (npu_fusion_attention)")
        assert "attention" in alert["annotations"]["description"]
        (nf,) = [a for a in agent.alerts() if a["alertname"] == "DumpNonFinite"]
        assert nf["evidence"]["evidence"]["op"] == op and nf["state"] == "firing"
    finally:
        agent.stop()


def test_scan_names_the_passes_behind_a_bad_graph_op_from_the_files_in_the_tree(tmp_path):
    """A CANN dump whose first bad op was made by two fusion passes; the executed graph
    (ge_proto_*_Build.txt) and fusion_result.json lie in the tree: scan finds them and names the
    passes with the switch file that turns off exactly them."""
    from support import dumps as W
    from support.dumps import ge_text
    d = tmp_path / "dump"
    d.mkdir()
    good = np.ones((2, 3), np.float32)
    bad = good.copy()
    bad[0, 1] = np.nan
    for i, (op_type, name, ins, outs) in enumerate([("MatMul", "mm_1", [good], [good]),
                                                     ("Add", "add_layernorm_fused", [good], [bad])]):
        W.write_cann_dump(str(d / W.dump_name(op_type, name, i + 1, 0, 1_700_000_000_000 + i)),
                          inputs=[W.tensor(a) for a in ins], outputs=[W.tensor(a) for a in outs])
    ops = [{"name": "mm_1", "type": "MatMul", "attrs": {"_datadump_original_op_names": ["mm_1"]}, "outputs": [{}]},
           {"name": "add_layernorm_fused", "type": "AddLayerNorm",
            "attrs": {"pass_name": ["AddLayerNormFusionPass", "TbeEltwiseFusionPass"],
                      "_datadump_original_op_names": ["add_1", "layernorm_1"]}, "outputs": [{}]}]
    (tmp_path / "ge_proto_00000001_Build.txt").write_text(ge_text([("g", ops)]))
    (tmp_path / "fusion_result.json").write_text(json.dumps({
        "graph_fusion": {"AddLayerNormFusionPass": {"match_times": "1", "effect_times": "1"}},
        "ub_fusion": {"TbeEltwiseFusionPass": {"match_times": "2", "effect_times": "1"}}}))
    _, r = cli("scan", tmp_path)
    s = r["fusion_suspect"]
    assert r["first_nonfinite"]["op"] == "add_layernorm_fused"
    assert s["kind"] == "graph_pass" and s["passes"] == ["AddLayerNormFusionPass", "TbeEltwiseFusionPass"]
    assert s["original_ops"] == ["add_1", "layernorm_1"]
    assert s["switch_cfg"] == {"Switch": {"GraphFusion": {"AddLayerNormFusionPass": "off"},
                                          "UBFusion": {"TbeEltwiseFusionPass": "off"}}}
    # named files win over what the tree holds; a bad one is an error, not a crash
    (tmp_path / "broken.json").write_text("{")
    code, r2 = cli("scan", d, "--fusion-report", tmp_path / "broken.json")
    assert any(e["path"] == "fusion" for e in r2["errors"]) and code in (1, 2)


def test_an_overflow_at_a_fused_graph_op_raises_fusion_suspected(tmp_path):
    """No op turned NaN/Inf, but Opdebug says the fused op overflowed first (its fp16 outputs
    saturate): scan names the passes and FusionSuspected fires, found by dump_overflow."""
    from support import dumps as W
    from support.dumps import ge_text
    ts = 1_709_294_400_000_000
    one, sat = np.ones((2, 3), np.float16), np.array([65504.0, 1.0, 2.0], np.float16)
    d = W.ge_step_dir(str(tmp_path), 0, 1)
    W.write_ops(d, [("MatMul", "mm_1", 10, [one, one], [one]), ("AddLayerNorm", "add_layernorm_fused", 11, [one], [sat])],
                ts)
    W.write_opdebug(f"{d}/{W.opdebug_name(9, 0, ts + 5)}", W.new_record(0, [1, 0, 11, 0, 65535, 65535, 0, 0, 0, 0],
                                                                         [0x20]))
    ops = [{"name": "add_layernorm_fused", "type": "AddLayerNorm",
            "attrs": {"pass_name": ["AddLayerNormFusionPass"], "_datadump_original_op_names": ["add_1", "ln_1"]},
            "outputs": [{}]}]
    (tmp_path / "ge_proto_00000001_Build.txt").write_text(ge_text([("g", ops)]))
    (tmp_path / "fusion_result.json").write_text(json.dumps({
        "graph_fusion": {"AddLayerNormFusionPass": {"match_times": "1", "effect_times": "1"}}}))
    _, r = cli("scan", tmp_path)
    assert r["first_nonfinite"] is None and r["overflows"][0]["op"] == "add_layernorm_fused"
    assert r["fusion_suspect"]["passes"] == ["AddLayerNormFusionPass"]
    (f,) = [f for f in r["findings"] if f["rule"] == "FusionSuspected"]
    assert f["op"] == "add_layernorm_fused" and f["evidence"]["found_by"] == "dump_overflow"
    assert f["evidence"]["switch_cfg"] == {"Switch": {"GraphFusion": {"AddLayerNormFusionPass": "off"},
                                                      "UBFusion": {}}}
    assert f["summary"].startswith("add_layernorm_fused is fused (AddLayerNormFusionPass)")
