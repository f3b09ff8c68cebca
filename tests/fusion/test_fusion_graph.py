"""The executed GE graph: the real ATC JSON of the corpus, protobuf text dumps written here the way
GE prints ``ge.proto.ModelDef`` (reference §2.7), bad files; ``precision-agent fusion graph``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import corpus_path
from precision_agent.fusion import prototext
from precision_agent.fusion.graph import GraphFormatError, parse_atc_json, parse_ge_text, read_graph_file
from support.dumps import ge_text


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precision_agent", "fusion", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.corpus
def test_real_atc_graph_slice_1218_maps_to_its_pass():
    g = read_graph_file(corpus_path("ascend", "atc_om_graph__msquickcmp_model.json"))
    assert g.format == "atc_json" and g.model == "sub_model" and len(g.ops) == 19
    op = g.op("Slice_1218")
    assert op is not None and op.type == "StridedSliceD"
    assert op.passes == ("ConstToAttrStridedSliceV2Fusion",) and op.fused
    assert op.original_ops == ("Slice_1218",)
    assert op.outputs[0].origin_name == "Slice_1218" and op.outputs[0].origin_output_index == 0
    assert [o.name for o in g.ops if o.fused] == ["Slice_1218"]
    # compiler-inserted casts: an empty original-op list, the output standing for the original tensor
    cast = g.op("trans_Cast_6")
    assert cast.original_ops == () and not cast.fused and cast.outputs[0].origin_name == "Slice_1218"
    assert [o.name for o in g.find("Gather_1221")] == ["PartitionedCall_Gather_1221_const_data_2",
                                                       "PartitionedCall_Gather_1221_gatherv2_3"]
    assert g.op("boxes_all").original_ops is None


# --- protobuf text written as GE's DumpGEGraph prints it -------------------------------------------


OPS = [
    {"name": "x", "type": "Data", "outputs": [{}]},
    {"name": "trans_TransData_1", "type": "TransData", "inputs": ["x:0"],
     "attrs": {"_datadump_original_op_names": []},
     "outputs": [{"_datadump_origin_name": "x", "_datadump_origin_output_index": 0}]},
    {"name": "layer1/conv_bn\u5c42", "type": "Conv2D", "inputs": ["trans_TransData_1:0"],
     "attrs": {"pass_name": ["ConvBatchnormFusionPass", "AABiasaddConvFusion"],
               "_datadump_original_op_names": ["layer1/conv", "layer1/bn\u5c42", 'we"ird\\name'],
               "_datadump_is_multiop": True, "layer1/conv_bn\u5c42_kernelname": "te_conv2d_1",
               "_op_slice_info": '{"a": "b\\n"}'},
     "outputs": [{"_datadump_origin_name": "layer1/bn\u5c42", "_datadump_origin_output_index": 0},
                 {"_datadump_origin_name": "layer1/bn\u5c42", "_datadump_origin_output_index": 2}]},
    {"name": "Relu_3", "type": "Relu", "inputs": ["layer1/conv_bn\u5c42:0"],
     "attrs": {"_datadump_original_op_names": ["Relu_3"]}, "outputs": [{"_datadump_origin_name": "Relu_3"}]},
]
SUB = [{"name": "sub_add", "type": "Add", "attrs": {"pass_name": ["TbeEltwiseFusionPass"],
                                                   "_datadump_original_op_names": ["a", "b"]}, "outputs": [{}]}]


def _check_fixture_graph(g):
    assert g.graphs == ["ge_default", "ge_default_sub_graph_1"] and len(g.ops) == 5
    conv = g.op("layer1/conv_bn\u5c42")
    assert conv.type == "Conv2D" and conv.graph == "ge_default"
    assert conv.passes == ("ConvBatchnormFusionPass", "AABiasaddConvFusion") and conv.fused
    assert conv.original_ops == ("layer1/conv", "layer1/bn\u5c42", 'we"ird\\name')
    assert [(o.index, o.origin_name, o.origin_output_index) for o in conv.outputs] == [
        (0, "layer1/bn\u5c42", 0), (1, "layer1/bn\u5c42", 2)]
    inserted = g.op("trans_TransData_1")
    assert inserted.original_ops == () and not inserted.fused and inserted.outputs[0].origin_name == "x"
    relu = g.op("Relu_3")
    assert relu.passes == () and not relu.fused and relu.outputs[0].origin_output_index is None
    assert g.op("x").original_ops is None
    sub = g.op("sub_add")
    assert sub.graph == "ge_default_sub_graph_1" and sub.fused and sub.passes == ("TbeEltwiseFusionPass",)
    assert [o.name for o in g.find("layer1/conv")] == ["layer1/conv_bn\u5c42"]


def test_ge_text_dump_parses(tmp_path):
    f = tmp_path / "ge_proto_00000179_Build.txt"
    f.write_text(ge_text([("ge_default", OPS), ("ge_default_sub_graph_1", SUB)]), encoding="utf-8")
    g = read_graph_file(f)
    assert g.format == "ge_text" and g.model == "ge_default_model"
    _check_fixture_graph(g)


def test_ge_text_and_atc_json_of_one_graph_agree(tmp_path):
    """The same graph as the ATC JSON shape (as atc --mode=5 converts a ge_proto txt) gives the same ops."""
    def atc_attrs(attrs):
        out = []
        for k, v in attrs.items():
            val = ({"list": {"s": v, "val_type": "VT_LIST_STRING"}} if isinstance(v, list)
                   else {"b": v} if isinstance(v, bool) else {"i": v} if isinstance(v, int) else {"s": v})
            out.append({"key": k, "value": val})
        return out
    doc = {"name": "ge_default_model", "version": 2, "attr": [], "graph": [
        {"name": gname, "input": [], "attr": [], "op": [
            {"name": op["name"], "type": op["type"], "input": op.get("inputs", []), "attr": atc_attrs(op.get("attrs", {})),
             "output_desc": [{"dtype": "DT_FLOAT", "attr": atc_attrs(o)} for o in op.get("outputs", [])]}
            for op in ops]}
        for gname, ops in (("ge_default", OPS), ("ge_default_sub_graph_1", SUB))]}
    j = tmp_path / "graph.json"
    j.write_text(json.dumps(doc))
    t = tmp_path / "ge_proto_00000001_Build.txt"
    t.write_text(ge_text([("ge_default", OPS), ("ge_default_sub_graph_1", SUB)]))
    gj, gt = read_graph_file(j), read_graph_file(t)
    _check_fixture_graph(gj)
    assert gj.ops == gt.ops


def test_prototext_syntax_variants():
    text = ('# a comment\nname: "m" "odel"  # adjacent strings concatenate\n'
            "graph: { name: 'g' op < name: \"a\\x41\\101\\u00e9\" type: \"T\"; attr { key: \"pass_name\" "
            "value { list { s: [\"P1\", \"P2\"] } } } >, }\n"
            "attr { key: \"f\" value { f: -1.5e3 } } attr { key: \"h\" value { i: 0x1F } } "
            "attr { key: \"n\" value { f: -inf } }\n")
    root = prototext.parse(text)
    assert root.get("name") == "model"
    op = root.messages("graph")[0].messages("op")[0]
    assert op.get("name") == "aAAé"
    vals = [a.get("value").fields[0][1] for a in root.messages("attr")]
    assert vals == [-1500.0, 31, float("-inf")]
    from precision_agent.fusion.graph import parse_ge_text
    g = parse_ge_text(text, "x.txt")
    assert g.ops[0].passes == ("P1", "P2") and g.graphs == ["g"]


@pytest.mark.parametrize("text, reason", [
    ("graph {\n  op {\n    name: \"a\"\n", "truncated: 2 block(s) not closed"),
    ("graph {\n  op {\n    name: \"a\n  }\n}\n", "unexpected character"),
    ("graph { op { name \"a\" } }", "expected ':' or '{' after 'name'"),
    ("graph { op { name: } }", "expected a value"),
    ("graph { } }", "unexpected '}'"),
    ("graph { op { name: \"a\\q\" } }", "unknown escape"),
    ("x {" * 100 + "}" * 100, "nested deeper than 64 blocks"),
    ("name: \"only a name\"\n", "no graph in this protobuf text"),
    ("graph { input: [\"a\", \"b\"", "list of 'input' not closed"),
])
def test_bad_ge_text_gives_clear_errors(tmp_path, text, reason):
    f = tmp_path / "ge_proto_00000002_Build.txt"
    f.write_text(text)
    with pytest.raises(GraphFormatError) as err:
        read_graph_file(f)
    assert err.value.file == str(f) and reason in err.value.reason, err.value.reason


def test_bad_graph_files(tmp_path):
    cases = {"empty.txt": "", "broken.json": '{"graph": [', "nograph.json": '{"name": "m"}',
             "deep.json": "[" * 200000 + "]" * 200000}
    reasons = {"empty.txt": "empty file", "broken.json": "not JSON", "nograph.json": "no 'graph' list",
               "deep.json": "nested too deeply"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(GraphFormatError, match=reasons[name]):
            read_graph_file(tmp_path / name)
    huge = tmp_path / "huge.txt"
    huge.write_text("graph { }")
    with pytest.raises(GraphFormatError, match="too big"):
        read_graph_file(huge, max_bytes=4)
    with pytest.raises(GraphFormatError):
        parse_atc_json([], "x")


def test_cli_graph_json_and_op_filter(tmp_path):
    f = tmp_path / "ge_proto_00000179_Build.txt"
    f.write_text(ge_text([("ge_default", OPS), ("ge_default_sub_graph_1", SUB)]))
    p = cli("graph", f, "--json", "--op", "layer1/conv")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["format"] == "ge_text" and doc["ops"] == 5 and doc["fused_ops"] == 2
    assert doc["op_list"] == [{
        "name": "layer1/conv_bn\u5c42", "type": "Conv2D", "graph": "ge_default",
        "passes": ["ConvBatchnormFusionPass", "AABiasaddConvFusion"],
        "original_ops": ["layer1/conv", "layer1/bn\u5c42", 'we"ird\\name'], "fused": True,
        "outputs": [{"index": 0, "origin_name": "layer1/bn\u5c42", "origin_output_index": 0},
                    {"index": 1, "origin_name": "layer1/bn\u5c42", "origin_output_index": 2}]}]
    text = cli("graph", f, "--fused")
    assert text.returncode == 0 and "ConvBatchnormFusionPass,AABiasaddConvFusion" in text.stdout
    assert "sub_add" in text.stdout and "Relu_3" not in text.stdout
    missing = cli("graph", f, "--op", "nope")
    assert missing.returncode == 2 and "no op named 'nope'" in missing.stderr
    bad = tmp_path / "bad.txt"
    bad.write_text("graph {")
    p = cli("graph", bad)
    assert p.returncode == 2 and "truncated" in p.stderr


@pytest.mark.corpus
def test_cli_graph_on_real_atc_json():
    p = cli("graph", corpus_path("ascend", "atc_om_graph__msquickcmp_model.json"), "--op", "Slice_1218", "--json")
    assert p.returncode == 0, p.stderr
    op = json.loads(p.stdout)["op_list"][0]
    assert op["passes"] == ["ConstToAttrStridedSliceV2Fusion"] and op["original_ops"] == ["Slice_1218"]


_PIECES = st.sampled_from(['graph', 'op', '{', '}', '<', '>', ':', '[', ']', ',', ';', 'name', '"a\\101"',
                           '"\\q"', "'x'", '-1', '0x1F', '1.5e3', 'true', '-inf', '#c\n', '\n', ' ', '"', '\\',
                           'attr', 'key: "pass_name"', 'value', 'list', 's: "P"', '\x00', '\u5c42'])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=60) | st.text(max_size=200))
def test_any_text_gives_a_graph_or_a_clear_error(pieces):
    """Hostile input: the reader returns a graph or raises GraphFormatError, nothing else."""
    from precision_agent.fusion.graph import parse_ge_text
    text = "".join(pieces) if isinstance(pieces, list) else pieces
    try:
        g = parse_ge_text(text, "f.txt")
    except GraphFormatError as exc:
        assert exc.file == "f.txt" and exc.reason
    else:
        assert all(isinstance(o.name, str) and isinstance(o.passes, tuple) for o in g.ops)


def test_a_long_parse_beats_the_heartbeat_and_skips_weights():
    """The parser beats the calling thread's heartbeat as it goes (a cancelled one stops it, as it
    stops a dump scan), and a weight string is kept as it stands, not decoded."""
    from precision_agent import health
    from support.dumps import ge_text
    ops = [{"name": f"op{i}", "type": "Add", "attrs": {"pass_name": ["P"]}, "outputs": [{}]} for i in range(2000)]
    text = ge_text([("g", ops)])
    hb = health.Heartbeat("scan", busy=True)
    hb.cancelled = True
    health.bind(hb)
    try:
        with pytest.raises(health.Cancelled):
            prototext.parse(text)
    finally:
        health.bind(None)
    weights = "\\000\\200?" * 30000
    root = prototext.parse(f'name: "g" t {{ data: "{weights}" }} s: "a\\tb"', max_string=1000)
    data = root.messages("t")[0].get("data")
    assert isinstance(data, prototext.Unread) and data == weights and root.get("s") == "a\tb"
    i = text.rindex("}")
    g = parse_ge_text(text[:i] + f'  op {{\n    name: "w"\n    type: "Const"\n    attr {{ key: "value" value {{ t {{ data: "{weights * 3}" }} }} }}\n  }}\n' + text[i:], "x")
    assert len(g.ops) == 2001 and g.ops[-1].type == "Const"
