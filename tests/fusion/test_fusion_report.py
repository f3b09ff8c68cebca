"""fusion_result.json in every shape of reference §2.8: the three real reports, generated array and
back-to-back files, bad files; ``precision-agent fusion passes`` as a real command."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import corpus_path
from support.fusion import cli, report_text
from precision_agent.fusion.report import (MAX_REPORT_BYTES, FusionReportError, load_reports, merge,
                                           parse_report_text, read_report_file)

# What precision_tool's fusion check prints for each real report: the passes with int(effect_times) > 0,
# one table for graph_fusion and one for ub_fusion (reference §1.6), read off the files by hand.
CTPN_GRAPH = ["ConstToAttrPass", "ConstToAttrStridedSliceV2Fusion", "GRUFusionPass", "MapIndexFusionPass",
              "RefreshInt64ToInt32FusionPass", "TransposedUpdateFusionPass", "ZSplitDFusionPass"]
CTPN_UB = ["TbeCommonRules0FusionPass"]
PHOTO_GRAPH = ["AABiasaddConvFusion", "BatchNormBnInferFusionPass", "ConcatCToNOptimizeFusionPass",
               "Conv2DbpInputBiasAddFusionPass", "ConvBatchnormFusionPass", "HostBNFusionPass",
               "MulMaximumFusionPass", "TransposedUpdateFusionPass"]
PHOTO_UB = ["AutomaticUbFusion", "TbeCommonRules0FusionPass", "TbeDxElemwisePass", "TbeEltwiseFusionPass"]


def _effective_tables(report) -> tuple[list[str], list[str]]:
    return (sorted(p for p, c in report.graph_fusion.items() if c.effect_times > 0),
            sorted(p for p, c in report.ub_fusion.items() if c.effect_times > 0))


@pytest.mark.corpus
def test_real_flat_reports_match_precision_tools_listing():
    ctpn = load_reports([corpus_path("ascend", "fusion_result__atc_ctpn_flat.json")])
    assert len(ctpn.graphs) == 1 and ctpn.graphs[0].graph_id == "0_0"
    assert _effective_tables(ctpn) == (CTPN_GRAPH, CTPN_UB)
    assert ctpn.effective == sorted(CTPN_GRAPH + CTPN_UB)
    assert ctpn.graph_fusion["ConstToAttrPass"].match_times == 70
    assert "ConvToFullyConnectionFusionPass" in ctpn.matched_only and len(ctpn.graph_fusion) == 19

    photo = load_reports([corpus_path("ascend", "fusion_result__photo_translator_flat.json")])
    assert _effective_tables(photo) == (PHOTO_GRAPH, PHOTO_UB)
    assert photo.kinds("AutomaticUbFusion") == ("UBFusion",)
    assert photo.kinds("ConvBatchnormFusionPass") == ("GraphFusion",)
    assert "softmaxTransFusionPass" in photo.matched_only


@pytest.mark.corpus
def test_real_keyed_report_has_nothing_effective():
    verl = load_reports([corpus_path("ascend", "fusion_result__verl_keyed.json")])
    assert [g.graph_id for g in verl.graphs] == ["0_0"]
    assert verl.effective == [] and verl.ub_fusion == {}
    assert verl.matched_only == ["RefreshInt64ToInt32FusionPass", "TransdataCastFusionPass",
                                 "TransdataFz2FzgFusionPass", "TransdataFzg2FzFusionPass"]


def _graph_obj(gid: str, graph: dict[str, tuple[int, int]], ub: dict[str, tuple[int, int]]) -> dict:
    def table(t):
        return {p: {"effect_times": str(e), "match_times": str(m)} for p, (m, e) in t.items()}
    return {"graph_fusion": table(graph), "session_and_graph_id": gid, "ub_fusion": table(ub)}


GRAPHS = [("0_0", {"APass": (3, 3), "BPass": (2, 0)}, {"UbX": (5, 5)}),
          ("0_1", {"APass": (1, 1), "CPass": (4, 0)}, {"UbY": (2, 0)}),
          ("1_0", {"BPass": (6, 0), "DPass": (1, 1)}, {})]


def _check_three_graphs(graphs, ids=("0_0", "0_1", "1_0")):
    assert [g.graph_id for g in graphs] == list(ids)
    report = merge(["x"], graphs)
    assert report.effective == ["APass", "DPass", "UbX"]
    assert report.matched_only == ["BPass", "CPass", "UbY"]
    assert report.graph_fusion["APass"].match_times == 4 and report.graph_fusion["BPass"].match_times == 8


def test_array_shape(tmp_path):
    f = tmp_path / "fusion_result.json"
    f.write_text(json.dumps([_graph_obj(*g) for g in GRAPHS], indent=4))
    _check_three_graphs(read_report_file(f))


def test_back_to_back_objects_of_every_shape(tmp_path):
    """Older CANN wrote one object per graph with no separator; mixed with the keyed shape too."""
    objs = [json.dumps(_graph_obj(*g), indent=4) for g in GRAPHS[:2]]
    keyed = {"session_and_graph_id_1_0": {k: v for k, v in _graph_obj(*GRAPHS[2]).items()
                                          if k != "session_and_graph_id"}}
    f = tmp_path / "fusion_result.json"
    f.write_text(objs[0] + objs[1] + "\n" + json.dumps(keyed))   # "}{" with no separator at all
    _check_three_graphs(read_report_file(f))


def test_keyed_shape_and_counts_as_strings_or_numbers():
    text = json.dumps({"session_and_graph_id_0_0": {"graph_fusion": {"P": {"match_times": 2, "effect_times": "1"}}},
                       "session_and_graph_id_3_7": {"ub_fusion": {"U": {"match_times": "9", "effect_times": "0",
                                                                      "repository_hit_times": "4"}}}})
    graphs = parse_report_text(text)
    assert [g.graph_id for g in graphs] == ["0_0", "3_7"]
    assert graphs[1].ub_fusion["U"].repository_hit_times == 4


@pytest.mark.parametrize("text, reason", [
    ("", "empty file"),
    ("   \n", "empty file"),
    ('{"graph_fusion": {"P": {"match_times": "1", "effect_', "truncated"),
    ('{"graph_fusion": {"P": {"match_times": "1", "effect_times": "1"}}}}', "not JSON"),
    ("[1, 2]", "not a graph's fusion object"),
    ('"text"', "expected an object or an array"),
    ('{"foo": 1}', "not a fusion report"),
    ('{"graph_fusion": {"P": {"match_times": "x", "effect_times": "1"}}}', "P.match_times: not a count"),
    ('{"graph_fusion": {"P": {"match_times": "-3", "effect_times": "1"}}}', "not a count"),
    ('{"graph_fusion": {"P": {"match_times": "1"}}}', "P: no effect_times"),
    ('{"graph_fusion": {"P": "1"}}', "P: expected"),
    ('{"graph_fusion": ["P"]}', "expected an object of passes"),
    ('{"session_and_graph_id_0_0": [1]}', "session_and_graph_id_0_0: expected an object"),
    ('{"graph_fusion": {"P": {"match_times": "1", "effect_times": "99999999999999999999"}}}', "not a count"),
    ("[" * 200000 + "]" * 200000, "nested too deeply"),
])
def test_bad_reports_give_clear_errors(tmp_path, text, reason):
    f = tmp_path / "fusion_result.json"
    f.write_text(text)
    with pytest.raises(FusionReportError) as err:
        read_report_file(f)
    assert err.value.file == str(f) and reason in err.value.reason, err.value.reason


def test_huge_missing_and_binary_files_refused(tmp_path):
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:               # sparse: no disk used
        fh.truncate(MAX_REPORT_BYTES + 1)
    with pytest.raises(FusionReportError, match="too big"):
        read_report_file(huge)
    with pytest.raises(FusionReportError, match="No such file"):
        read_report_file(tmp_path / "absent.json")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b'{"graph_fusion": {"\xff\xfe": {}}}')
    with pytest.raises(FusionReportError, match="not UTF-8"):
        read_report_file(binary)


@pytest.mark.corpus
def test_cli_passes_json_contract_on_real_reports():
    ctpn = corpus_path("ascend", "fusion_result__atc_ctpn_flat.json")
    verl = corpus_path("ascend", "fusion_result__verl_keyed.json")
    p = cli("passes", ctpn, verl, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert {"graphs", "graph_fusion", "ub_fusion", "effective", "matched_only", "per_graph"} <= set(doc)
    assert doc["graphs"] == 2
    assert doc["effective"] == sorted(CTPN_GRAPH + CTPN_UB)
    assert doc["graph_fusion"]["RefreshInt64ToInt32FusionPass"] == {"match_times": 12, "effect_times": 11}
    assert doc["ub_fusion"]["TbeCommonRules0FusionPass"] == {"match_times": 150, "effect_times": 150}
    assert "TransdataFz2FzgFusionPass" in doc["matched_only"]
    assert sorted(doc["per_graph"]) == [f"{ctpn.name}:0_0", f"{verl.name}:0_0"]
    assert doc["per_graph"][f"{verl.name}:0_0"]["ub_fusion"] == {}
    text = cli("passes", ctpn)
    assert text.returncode == 0 and "Graph Fusion: 7 effective, 12 matched only" in text.stdout
    assert "UB Fusion: 1 effective" in text.stdout and "(matched only)" in text.stdout


def test_cli_passes_bad_file_exits_2(tmp_path):
    f = tmp_path / "fusion_result.json"
    f.write_text('{"graph_fusion": {"P": {"match_times": "1"')
    p = cli("passes", f, "--json")
    assert p.returncode == 2 and p.stdout == ""
    assert f"bad fusion report: {f}: truncated" in p.stderr


def test_repeated_graph_ids_stay_apart_in_per_graph():
    """Two back-to-back objects for one graph id (a graph compiled twice) are both kept."""
    from precision_agent.fusion.report import report_json
    one = json.dumps(_graph_obj("0_0", {"APass": (1, 1)}, {}))
    two = json.dumps(_graph_obj("0_0", {"APass": (2, 0)}, {}))
    doc = report_json(merge(["f"], parse_report_text(one + two)))
    assert sorted(doc["per_graph"]) == ["0_0", "0_0#2"] and doc["graphs"] == 2
    assert doc["graph_fusion"]["APass"] == {"match_times": 3, "effect_times": 1}


_JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5)
                        | st.sampled_from(["1", "-1", "x", "graph_fusion", "ub_fusion"]),
                        lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.sampled_from(["graph_fusion", "ub_fusion", "session_and_graph_id",
                                                           "session_and_graph_id_0_1", "match_times",
                                                           "effect_times", "P"]), inner, max_size=4),
                        max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.lists(_JSONISH, min_size=1, max_size=3), st.integers(0, 40))
def test_any_json_gives_a_report_or_a_clear_error(docs, cut):
    """Hostile input: any JSON values back to back (or cut short) give graphs or FusionReportError."""
    text = "".join(json.dumps(d) for d in docs)
    for t in (text, text[:max(0, len(text) - cut)]):
        try:
            graphs = parse_report_text(t, "f.json")
        except FusionReportError as exc:
            assert exc.file == "f.json" and exc.reason
        else:
            assert all(c.effect_times >= 0 for g in graphs for c in g.graph_fusion.values())


@pytest.mark.parametrize("what", ["passes", "graph", "bisect"])
def test_cli_refuses_a_fifo_named_like_a_fusion_file_at_once(tmp_path, what):
    """A FIFO named fusion_result.json (or a graph, or a session file) is refused with a clear error;
    a plain open() would wait forever for a writer (cli's timeout fails the test then)."""
    import os
    name = {"passes": "fusion_result.json", "graph": "ge_proto_00000001_Build.txt", "bisect": "s.json"}[what]
    fifo = tmp_path / name
    os.mkfifo(fifo)
    args = {"passes": ("passes", fifo, "--json"), "graph": ("graph", fifo),
            "bisect": ("bisect", "--session", fifo, "--json")}[what]
    p = cli(*args)
    assert p.returncode == 2 and p.stdout == ""
    assert f"{fifo}" in p.stderr and "not a regular file (a FIFO)" in p.stderr


def test_discovery_reaches_a_shallow_graphs_folder_after_a_big_dump_and_says_when_cut_short(tmp_path):
    """The compiler's files in a tree (scan, and the daemon's pickup): breadth-first, so graphs/
    beside a dump/ of more entries than the walk's bound is reached; a walk that stops early says so."""
    from precision_agent.daemon.fusionfiles import FusionPickup
    from precision_agent.fusion.context import MAX_WALK, discover, load_context
    deep = tmp_path / "dump" / "deep"
    deep.mkdir(parents=True)
    for i in range(MAX_WALK + 50):
        (deep / f"op_{i:05d}.npy").touch()
    (tmp_path / "graphs").mkdir()
    g = tmp_path / "graphs" / "ge_proto_00000001_Build.txt"
    g.write_text('graph { name: "g" op { name: "f" type: "X" } }\n')
    rep = tmp_path / "graphs" / "fusion_result.json"
    rep.write_text(json.dumps({"graph_fusion": {"P": {"match_times": "1", "effect_times": "1"}}}))
    found = discover(tmp_path)
    assert (found.report, found.graph) == (rep, g)
    assert found.cut_short and f"first {MAX_WALK} entries" in found.cut_short
    ctx = load_context(root=tmp_path)
    assert ctx.report is not None and ctx.graph is not None
    # a search cut at its bound is a note, never an error (it cannot fail a clean scan)
    assert ctx.errors == [] and len(ctx.warnings) == 1 and f"first {MAX_WALK} entries" in ctx.warnings[0]
    daemon = FusionPickup(lambda unit: ("job", [tmp_path])).context("/job/step1")
    assert daemon.graph is not None and daemon.errors == []
    assert any(f"first {MAX_WALK} entries" in e for e in daemon.warnings)
    assert discover(tmp_path / "graphs").cut_short is None


@pytest.mark.parametrize("count", ["²", "١٢", "3\u00b3"])
def test_non_ascii_digit_counts_are_clear_errors_not_crashes(tmp_path, count):
    """"²".isdigit() is True but int("²") raises: such a count is a bad report (exit 2), not a crash."""
    f = tmp_path / "fusion_result.json"
    f.write_text(json.dumps({"graph_fusion": {"P": {"match_times": count, "effect_times": "1"}}}), encoding="utf-8")
    with pytest.raises(FusionReportError, match="P.match_times: not a count"):
        read_report_file(f)
    p = cli("passes", f, "--json")
    assert p.returncode == 2 and "not a count" in p.stderr and "Traceback" not in p.stderr


def test_cli_refuses_a_fifo_as_the_session_lock_at_once(tmp_path):
    """The session's lock file is opened without blocking: a FIFO in its place is a clear error."""
    import os
    (tmp_path / "r.json").write_text(report_text(4))
    os.mkfifo(tmp_path / "s.json.lock")
    p = cli("bisect", "--passes", tmp_path / "r.json", "--session", tmp_path / "s.json", "--json")
    assert p.returncode == 2 and p.stdout == ""
    assert "s.json.lock" in p.stderr and "not a regular file" in p.stderr
