"""Comparing across fusion (issue 11, part 3): a fusion-on run against a fusion-off run, which do
not have the same ops, paired at the level both share.

msprobe: real dumps written by msprobe (mindstudio-probe) at level mix, one training step of a tiny
attention model (tests/fixtures/msprobe_fusion/make.py): fusion on (``scaled_dot_product_attention``),
fusion off (matmul + softmax + matmul), and a fault planted inside the fused API. Graph dumps: CANN
dumps with the fusion-on run's executed graph (msaccucmp's one-to-one and many-to-one relations)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "msprobe_fusion"
SDPA = "Functional.scaled_dot_product_attention.0.forward"
ATTN = "Module.attn.Attention.forward.0"


def cli(*args: object) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "precision_agent", *map(str, args), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_the_fixtures_are_real_msprobe_mix_dumps():
    for run in ("on_clean", "on_rerun", "on_fault", "on_nan", "off"):
        (rank,) = (FIX / run / "step0").iterdir()
        doc = json.loads((rank / "dump.json").read_text())
        assert doc["level"] == "mix" and doc["framework"] == "pytorch"
        assert ATTN in doc["data"] and (rank / "construct.json").is_file()
        assert (SDPA in doc["data"]) == run.startswith("on_")


def test_a_fault_planted_inside_the_fused_api_is_named():
    rc, c = cli("compare", FIX / "on_clean", FIX / "on_fault")
    assert rc == 1 and c["verdict"] == "lost_precision" and c["first_diverging_op"]["op"] == SDPA
    s = c["fusion_suspect"]
    assert s["kind"] == "fused_api" and s["api"] == "scaled_dot_product_attention" and s["op"] == SDPA
    assert c["across_fusion"] is None and c["fused_away"] == []
    _, r = cli("scan", FIX / "on_nan")
    assert r["first_nonfinite"]["op"] == SDPA and r["fusion_suspect"]["api"] == "scaled_dot_product_attention"


@pytest.mark.parametrize("bench, target, fused_side", [("off", "on_fault", "target"), ("on_fault", "off", "bench")])
def test_fusion_off_against_fusion_on_names_the_first_diverging_module_and_the_fused_api_in_it(bench, target,
                                                                                               fused_side):
    rc, c = cli("compare", FIX / bench, FIX / target)
    assert rc == 1 and c["verdict"] == "lost_precision"
    assert c["first_diverging_op"]["op"] == ATTN and c["first_diverging_op"]["inputs_match"]
    assert c["corrupted_input"] is None   # the modules inside Attention are fed by it
    s = c["fusion_suspect"]
    assert s["op"] == ATTN and s["kind"] == "fused_api" and s["api"] == "scaled_dot_product_attention"
    assert s["fused_ops"] == [SDPA]
    a = c["across_fusion"]
    assert a["level"] == "module" and a["fused_side"] == fused_side
    # entries of one run only are fused away, not unmatched errors
    assert c["unmatched"] == []
    away = {(f["side"], f["op"]) for f in c["fused_away"]}
    off_side = "bench" if fused_side == "target" else "target"
    assert (fused_side, SDPA) in away and (off_side, "Torch.matmul.0.forward") in away
    assert (off_side, "Torch.softmax.0.forward") in away
    assert all(r["op"].startswith("Module.") for r in c["rows"])
    text = subprocess.run([sys.executable, "-m", "precision_agent", "compare", FIX / bench, FIX / target],
                          capture_output=True, text=True, timeout=120).stdout
    assert f"across fusion: the fusion-on run is the {fused_side}" in text
    assert f"fusion suspect: {ATTN} (fused_api: {SDPA})" in text


@pytest.mark.parametrize("bench, target", [("on_clean", "on_rerun"), ("off", "on_clean"), ("on_clean", "off")])
def test_clean_runs_give_no_suspect(bench, target):
    rc, c = cli("compare", FIX / bench, FIX / target)
    assert rc == 0 and not c["diverged"] and c["fusion_suspect"] is None and c["unmatched"] == []
    assert c["first_diverging_op"] is None and c["corrupted_input"] is None
    assert (c["across_fusion"] is None) == ("off" not in (bench, target))   # two fusion-on runs pair as usual


# --- graph dumps: the fusion-on run's executed graph maps its ops to the original ops ----------------

def _cann(d: Path, ops: list[tuple[str, str, list[np.ndarray], list[np.ndarray]]]) -> None:
    from support import dumps as W
    d.mkdir(parents=True)
    for i, (op_type, name, ins, outs) in enumerate(ops):
        W.write_cann_dump(str(d / W.dump_name(op_type, name, i + 1, 0, 1_700_000_000_000 + i)),
                          inputs=[W.tensor(a) for a in ins], outputs=[W.tensor(a) for a in outs])


def _graph_runs(tmp_path: Path, drift: float) -> tuple[Path, Path]:
    from support.dumps import ge_text
    rnd = np.random.default_rng(3)
    x = rnd.standard_normal((4, 8)).astype(np.float32)
    w = rnd.standard_normal((8, 8)).astype(np.float32)
    mm = x @ w
    added = mm + 1.0
    norm = (added - added.mean(-1, keepdims=True)) / added.std(-1, keepdims=True)
    out = np.tanh(norm)
    off, on = tmp_path / "off", tmp_path / "on"
    _cann(off, [("MatMul", "mm_1", [x, w], [mm]), ("Add", "add_1", [mm], [added]),
                ("LayerNorm", "layernorm_1", [added], [norm]), ("Tanh", "tanh_1", [norm], [out])])
    fused = (norm * np.float32(drift)).astype(np.float32)
    _cann(on / "dump", [("MatMul", "mm_1", [x, w], [mm]), ("Cast", "trans_Cast_3", [mm], [mm]),
                        ("AddLayerNorm", "add_layernorm_fused", [mm], [fused]),
                        ("Tanh", "tanh_1", [fused], [np.tanh(fused)])])
    ops = [{"name": "mm_1", "type": "MatMul", "attrs": {"_datadump_original_op_names": ["mm_1"]}, "outputs": [{}]},
           {"name": "trans_Cast_3", "type": "Cast", "attrs": {"_datadump_original_op_names": []}, "outputs": [{}]},
           {"name": "add_layernorm_fused", "type": "AddLayerNorm",
            "attrs": {"pass_name": ["AddLayerNormFusionPass"], "_datadump_original_op_names": ["add_1", "layernorm_1"]},
            "outputs": [{"_datadump_origin_name": "layernorm_1", "_datadump_origin_output_index": 0}]},
           {"name": "tanh_1", "type": "Tanh", "attrs": {"_datadump_original_op_names": ["tanh_1"]}, "outputs": [{}]}]
    (on / "ge_proto_00000001_Build.txt").write_text(ge_text([("g", ops)]))
    (on / "fusion_result.json").write_text(json.dumps({
        "graph_fusion": {"AddLayerNormFusionPass": {"match_times": "1", "effect_times": "1"}}}))
    return off, on


def test_graph_dumps_pair_a_fused_op_with_the_original_op_it_stands_for(tmp_path):
    off, on = _graph_runs(tmp_path, 1.01)
    rc, c = cli("compare", off, on)
    assert rc == 1 and c["across_fusion"]["level"] == "graph" and c["across_fusion"]["fused_side"] == "target"
    f = c["first_diverging_op"]
    assert f["op"] == "add_layernorm_fused" and f["kind"] == "lost_precision"
    (row,) = [r for r in c["rows"] if r["op"] == "add_layernorm_fused"]
    assert row["bench_op"] == "layernorm_1" and row["tensor"] == "output[0]"   # many-to-one
    s = c["fusion_suspect"]
    assert s["kind"] == "graph_pass" and s["passes"] == ["AddLayerNormFusionPass"]
    assert s["switch_cfg"] == {"Switch": {"GraphFusion": {"AddLayerNormFusionPass": "off"}, "UBFusion": {}}}
    assert c["unmatched"] == []
    away = {(a["side"], a["op"]): a["reason"] for a in c["fused_away"]}
    assert away[("bench", "add_1")] == "merged into fused op add_layernorm_fused"
    assert away[("bench", "layernorm_1")] == "merged into fused op add_layernorm_fused"   # its input
    assert "inserted by the graph compiler" in away[("target", "trans_Cast_3")]
    assert "input of fused op" in away[("target", "add_layernorm_fused")]


def test_graph_dumps_clean_across_fusion_and_an_explicit_graph(tmp_path):
    off, on = _graph_runs(tmp_path, 1.0)
    rc, c = cli("compare", off, on / "dump", "--graph", on / "ge_proto_00000001_Build.txt")
    assert rc == 0 and c["fusion_suspect"] is None and c["unmatched"] == [] and c["across_fusion"]["level"] == "graph"
    assert {r["op"] for r in c["rows"]} == {"mm_1", "add_layernorm_fused", "tanh_1"}


def test_without_construct_json_the_fused_api_is_found_by_execution_order(tmp_path):
    import shutil
    on = tmp_path / "on_fault"
    shutil.copytree(FIX / "on_fault", on)
    for f in on.rglob("construct.json"):
        f.unlink()
    rc, c = cli("compare", FIX / "off", on)
    assert rc == 1 and c["first_diverging_op"]["op"] == ATTN and c["fusion_suspect"]["fused_ops"] == [SDPA]


def _with_catalogue(path: Path, *args: object) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "precision_agent", *map(str, args), "--json"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PRECISION_AGENT_FUSED_APIS": str(path)})
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_a_broken_user_catalogue_is_an_error_not_a_silent_switch_off(tmp_path):
    """$PRECISION_AGENT_FUSED_APIS names a broken file: `fusion_suspect` stays null | {op, kind, ...}
    (null here), and the reason is listed in `errors` (path "fusion catalogue") of scan and compare."""
    bad = tmp_path / "apis.yml"
    bad.write_text("fused_apis: [{api: x}]\n")
    _, r = _with_catalogue(bad, "scan", FIX / "on_nan")
    assert r["first_nonfinite"]["op"] == SDPA and r["fusion_suspect"] is None
    (e,) = [e for e in r["errors"] if e["path"] == "fusion catalogue"]
    assert str(bad) in e["reason"] and "needs 'api'" in e["reason"]
    _, c = _with_catalogue(bad, "compare", FIX / "off", FIX / "on_fault")
    assert c["fusion_suspect"] is None
    (e,) = [e for e in c["errors"] if e["path"] == "fusion catalogue"]
    assert str(bad) in e["reason"]


def test_a_broken_catalogue_is_listed_only_by_a_compare_that_consults_it(tmp_path):
    """Two identical trees: no first diverging op, every name paired, so no fused API is looked up
    and nothing is switched off by the broken file: a clean exit 0, as `scan` of a tree without a
    bad op; the same file with a diverging op is listed (the test above)."""
    bad = tmp_path / "apis.yml"
    bad.write_text("fused_apis: [{api: x}]\n")
    rc, c = _with_catalogue(bad, "compare", FIX / "off", FIX / "off")
    assert rc == 0 and c["identical"] is True
    assert [e for e in c["errors"] if e["path"] == "fusion catalogue"] == []
