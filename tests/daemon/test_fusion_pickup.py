"""agent/daemon/fusionfiles.py: the newest fusion report and graph over a job's places, parsed again only
when one changed, and an unreadable one reported once per version."""

from __future__ import annotations

import json
import os
from pathlib import Path

from precision_agent.daemon.fusionfiles import FusionPickup, newest_files
from support.dumps import ge_text

OPS = [{"name": "f", "type": "X", "attrs": {"pass_name": ["P1"], "_datadump_original_op_names": ["a", "b"]},
        "outputs": [{}]}]


def _report(path: Path, passes: list[str], mtime: int) -> Path:
    path.write_text(json.dumps({"graph_fusion": {p: {"match_times": "1", "effect_times": "1"} for p in passes}}))
    os.utime(path, ns=(mtime, mtime))
    return path


def test_the_newest_of_each_kind_over_files_and_folders(tmp_path):
    (tmp_path / "dumps" / "deep").mkdir(parents=True)
    old = _report(tmp_path / "dumps" / "deep" / "fusion_result.json", ["Old"], 1_000_000_000_000_000_000)
    new = _report(tmp_path / "fusion_result_1.json", ["New"], 2_000_000_000_000_000_000)
    atc = tmp_path / "model.json"
    atc.write_text("{}")
    g = tmp_path / "dumps" / "ge_proto_00000002_Build.txt"
    g.write_text(ge_text([("g", OPS)]))
    os.utime(g, ns=(1, 1))
    assert newest_files([tmp_path / "dumps", new, atc]) == (new, atc)
    assert newest_files([tmp_path / "dumps"]) == (old, g)
    assert newest_files([tmp_path / "missing"]) == (None, None)


def test_parsed_once_per_version_and_errors_reported_once(tmp_path):
    g = tmp_path / "ge_proto_00000001_Build.txt"
    g.write_text(ge_text([("g", OPS)]))
    rep = _report(tmp_path / "fusion_result.json", ["P1"], 1_000_000_000_000_000_000)
    pick = FusionPickup(lambda unit: ("job", [tmp_path]) if unit.startswith("/job") else None)
    assert pick.context("/other") is None
    first = pick.context("/job/step1")
    assert first.graph is not None and first.report is not None and first.report.effective == ["P1"]
    assert pick.context("/job/step2") is pick.latest["job"].ctx          # unchanged: not parsed again
    assert pick.context("/job/step2").graph is first.graph
    rep.write_text('{"graph_fusion": ')                                    # the job compiles again, badly
    bad = pick.context("/job/step3")
    assert bad.report is None and bad.graph is not None and "ends early" in bad.errors[0]
    assert pick.context("/job/step4").errors == []                         # once per version of the file
    result = {"first_nonfinite": {"op": "f"}, "overflows": [], "errors": [], "fusion_suspect": None}
    _report(rep, ["P1"], 3_000_000_000_000_000_000)
    pick.annotate("/job/step5", result)
    assert result["fusion_suspect"]["passes"] == ["P1"] and result["errors"] == []
    assert result["fusion_suspect"]["switch_cfg"] == {"Switch": {"GraphFusion": {"P1": "off"}, "UBFusion": {}}}


def test_a_fifo_named_like_a_fusion_file_is_an_error_not_a_hang(tmp_path):
    """The scan thread's pickup: FIFOs named like a report and a graph in the dump tree (and one
    named in fusion_files) give clear errors; a plain open() would block the thread forever."""
    import threading
    (tmp_path / "dump").mkdir()
    os.mkfifo(tmp_path / "dump" / "fusion_result.json")
    os.mkfifo(tmp_path / "dump" / "ge_proto_00000001_Build.txt")
    named = tmp_path / "model_graph.json"
    os.mkfifo(named)
    out: dict = {}
    for places in ([tmp_path / "dump"], [named]):
        pick = FusionPickup(lambda unit, places=places: ("job", places))
        t = threading.Thread(target=lambda: out.update(ctx=pick.context("/job/step1")), daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the pickup hangs on a FIFO"
        ctx = out.pop("ctx")
        assert ctx.graph is None and ctx.report is None
        assert ctx.errors and all("not a regular file (a FIFO)" in e for e in ctx.errors), ctx.errors
        assert len(ctx.errors) == (2 if places != [named] else 1)


def test_a_graph_over_the_pickup_limit_is_one_clear_error_and_not_parsed(tmp_path):
    """A 65 MiB executed graph (sparse: never read) would hold the scan thread for many seconds:
    the daemon refuses it with one error per version, and still takes the job's report."""
    from precision_agent.daemon.fusionfiles import PICKUP_GRAPH_BYTES
    assert PICKUP_GRAPH_BYTES == 64 << 20
    big = tmp_path / "ge_proto_00000001_Build.txt"
    with open(big, "wb") as fh:
        fh.truncate(PICKUP_GRAPH_BYTES + (1 << 20))
    _report(tmp_path / "fusion_result.json", ["P1"], 1_000_000_000_000_000_000)
    pick = FusionPickup(lambda unit: ("job", [tmp_path]))
    ctx = pick.context("/job/step1")
    assert ctx.graph is None and ctx.report is not None and ctx.report.effective == ["P1"]
    (err,) = ctx.errors
    assert str(big) in err and "too big for the daemon" in err and "limit 64 MiB" in err
    assert pick.context("/job/step2").errors == []
