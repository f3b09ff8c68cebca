"""Bisection to the fusion pass: a simulated culprit among N passes is named in at most ⌈log2 N⌉
rounds (worst case exactly), inconsistent oracles end cleanly, the session survives restarts
(every CLI call below is a new process), and the switch files are what CANN and precision_tool read."""

from __future__ import annotations

import functools
import json
import math

import pytest

from conftest import corpus_path
from precision_agent.fusion.bisect import (BisectError, BisectSession, dump_session, parse_session)
from precision_agent.fusion.report import merge, parse_report_text
from precision_agent.fusion.switch import SwitchError, parse_switch, switch_off
from support.fusion import cli, report_text


@functools.lru_cache(maxsize=4)
def _candidates(n: int) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    report = merge(["r"], parse_report_text(report_text(n)))
    return report.effective, {p: report.kinds(p) for p in report.effective}


def start(n: int) -> BisectSession:
    return BisectSession.start(["r"], *_candidates(n))


def run_to_end(s: BisectSession, good, roundtrip: bool = False) -> tuple[BisectSession, int]:
    """Answer rounds with ``good(off_set)`` until the culprit is named; returns the session (read
    back from its file text after every round when ``roundtrip``) and the rounds used."""
    rounds = 0
    while not s.done:
        rounds += 1
        assert rounds <= 20
        s.record("good" if good(set(s.off_now())) else "bad")
        if roundtrip:
            s = parse_session(dump_session(s))
    return s, rounds


@pytest.mark.parametrize("n", range(1, 201))
def test_every_culprit_named_within_ceil_log2_n_rounds(n):
    bound = math.ceil(math.log2(n)) if n > 1 else 0
    worst = 0
    for k in range(n):
        s = start(n)
        culprit = s.candidates[k]
        s, used = run_to_end(s, lambda off: culprit in off, roundtrip=(k % 37 == 0))
        assert s.culprit == culprit and s.status in ("found", "confirmed") and used <= bound
        if n & (n - 1) == 0:
            assert used == bound      # a power of two: every culprit takes exactly ⌈log2 N⌉ rounds
        worst = max(worst, used)
    assert worst == bound             # and ⌈log2 N⌉ is reached for some culprit whatever N


def test_confirmation_run_and_contradicted_final_candidate():
    s = start(10)
    culprit = s.candidates[7]
    s, _ = run_to_end(s, lambda off: culprit in off)
    assert s.status in ("found", "confirmed") and s.culprit == culprit
    ok = parse_session(dump_session(s))
    if ok.status == "found":
        ok.record("good")
    assert ok.status == "confirmed" and ok.culprit == culprit
    with pytest.raises(BisectError, match="finished"):
        ok.record("good")


@pytest.mark.parametrize("oracle", ["two_culprits", "never_good", "bad_alone"])
def test_inconsistent_oracle_ends_cleanly(oracle):
    s = start(16)
    a, b = s.candidates[2], s.candidates[11]
    good = {"two_culprits": lambda off: a in off and b in off,   # the run is healthy only with both off
            "never_good": lambda off: False,                     # fusion is not the cause after all
            "bad_alone": lambda off: a in off and len(off) > 1}[oracle]   # a only hurts together with others
    s, _ = run_to_end(s, good)
    assert s.status == "found"           # bisection always converges on one name...
    s.record("good" if good({s.culprit}) else "bad")    # ...which the confirmation run contradicts
    assert s.status == "inconsistent" and s.culprit is None and s.done
    doc = s.to_json("fusion_switch.cfg")
    assert "no single pass explains" in doc["message"]
    assert set(doc["off"]) == set(s.smallest_set) and len(s.smallest_set) >= 2
    if oracle != "never_good":
        assert good(set(s.smallest_set))        # the smallest set really is one that helped
    else:
        assert s.smallest_set == s.candidates   # only the premise (all off was healthy) is left
    with pytest.raises(BisectError, match="finished"):
        s.record("bad")


def test_no_effective_pass_and_bad_session_files():
    with pytest.raises(BisectError, match="no effective fusion pass"):
        BisectSession.start(["r"], [], {})
    for text, reason in [("{", "not JSON"), ('{"version": 9}', "not a fusion-bisect session"),
                         ('{"version": 1, "sections": {}, "status": "running", "candidates": ["a"], '
                          '"remaining": [], "smallest_set": [], "rounds": []}', "do not fit")]:
        with pytest.raises(BisectError, match=reason):
            parse_session(text)


def test_switch_file_shape_is_precision_tools(tmp_path):
    """Our switch files read back like precision_tool's own (corpus), with the pass in its section."""
    report = merge(["r"], parse_report_text(report_text(6)))
    cfg = switch_off(["G001FusionPass", "U003FusionPass"], report)
    doc = json.loads(cfg.render())
    assert doc == {"Switch": {"GraphFusion": {"G001FusionPass": "off"}, "UBFusion": {"U003FusionPass": "off"}}}
    assert parse_switch(cfg.render()) == cfg
    with pytest.raises(SwitchError, match="not a pass of the fusion report"):
        switch_off(["Unknown"], report)
    with pytest.raises(SwitchError, match="expected \"on\" or \"off\""):
        parse_switch('{"Switch": {"GraphFusion": {"A": 1}}}')


@pytest.mark.corpus
def test_precision_tool_switch_files_read():
    off = parse_switch(corpus_path("ascend", "precision_tool_fusion_off.cfg").read_text())
    assert off.graph_off == ("ALL",) and off.ub_off == ("ALL",)
    empty = parse_switch(corpus_path("ascend", "precision_tool_fusion_switch.cfg").read_text())
    assert empty.passes == ()


def test_cli_bisect_session_across_processes(tmp_path):
    """The real command, one process per round; the oracle reads the switch file the command wrote."""
    n = 37
    rep = tmp_path / "fusion_result.json"
    rep.write_text(report_text(n))
    session, cfg = tmp_path / "bisect.json", tmp_path / "fusion_switch.cfg"
    p = cli("bisect", "--passes", rep, "--session", session, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert {"round", "remaining", "switch_cfg", "culprit", "done"} <= set(doc)
    assert doc["round"] == 1 and len(doc["remaining"]) == n and doc["culprit"] is None and not doc["done"]
    culprit = "U009FusionPass"
    assert culprit in doc["remaining"] and "NeverFusionPass" not in doc["remaining"]
    rounds = 0
    while not doc["done"]:
        on_disk = parse_switch(cfg.read_text())
        assert json.loads(cfg.read_text()) == doc["switch_cfg"]
        assert set(on_disk.passes) == set(doc["off"]) and 0 < len(doc["off"]) < len(doc["remaining"])
        assert all(p.startswith("U") for p in on_disk.ub_off) and all(p.startswith("G") for p in on_disk.graph_off)
        healthy = culprit in on_disk.passes
        p = cli("bisect", "--session", session, "--result", "good" if healthy else "bad", "--json")
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        rounds += 1
    assert doc["culprit"] == culprit and doc["remaining"] == [culprit] and rounds <= math.ceil(math.log2(n))
    assert doc["round"] == rounds
    assert json.loads(cfg.read_text()) == {"Switch": {"GraphFusion": {}, "UBFusion": {culprit: "off"}}}
    # a plain call shows the state again without changing it
    again = cli("bisect", "--session", session, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["culprit"] == culprit
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bisect.json", "bisect.json.lock",
                                                          "fusion_result.json", "fusion_switch.cfg"]


def test_cli_bisect_inconsistent_and_bad_input(tmp_path):
    rep = tmp_path / "fusion_result.json"
    rep.write_text(report_text(8))
    session = tmp_path / "s.json"
    out = tmp_path / "out.cfg"
    assert cli("bisect", "--session", session).returncode == 2                      # no session, no report
    p = cli("bisect", "--passes", rep, "--session", session, "--result", "good")
    assert p.returncode == 2 and "no round to record" in p.stderr and not session.exists()
    assert cli("bisect", "--passes", rep, "--session", session, "--cfg", out).returncode == 0
    assert out.exists() and not (tmp_path / "fusion_switch.cfg").exists()
    doc = {}
    while not doc.get("done"):                        # "never good": fusion was not the cause
        p = cli("bisect", "--session", session, "--cfg", out, "--result", "bad", "--json")
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
    assert doc["status"] == "found" and doc["round"] == 3
    p = cli("bisect", "--session", session, "--cfg", out, "--result", "bad")
    assert p.returncode == 0 and "inconsistent answers" in p.stdout and "no single pass" in p.stdout
    p = cli("bisect", "--session", session, "--result", "bad")
    assert p.returncode == 2 and "finished" in p.stderr
    other = tmp_path / "other.json"
    other.write_text(report_text(9))
    p = cli("bisect", "--passes", other, "--session", session)
    assert p.returncode == 2 and "differ" in p.stderr
    none = tmp_path / "none.json"
    none.write_text(json.dumps({"graph_fusion": {"P": {"match_times": "1", "effect_times": "0"}}}))
    p = cli("bisect", "--passes", none, "--session", tmp_path / "n.json")
    assert p.returncode == 2 and "no effective fusion pass" in p.stderr
    session.write_text('{"version": 1, "rounds": ')
    p = cli("bisect", "--session", session, "--result", "good")
    assert p.returncode == 2 and "not a session file" in p.stderr
    bad_rep = tmp_path / "bad.json"
    bad_rep.write_text("{")
    p = cli("bisect", "--passes", bad_rep, "--session", tmp_path / "b.json")
    assert p.returncode == 2 and "bad fusion report" in p.stderr


@pytest.mark.parametrize("number", ['"x"', "null", "[1]", "true", "-1", '"\\u00b2"'])
def test_a_corrupt_round_number_in_the_session_file_is_a_clear_error(tmp_path, number):
    rep = tmp_path / "fusion_result.json"
    rep.write_text(report_text(5))
    session = tmp_path / "bisect.json"
    assert cli("bisect", "--passes", rep, "--session", session, "--json").returncode == 0
    doc = json.loads(session.read_text())
    doc["rounds"][0]["round"] = json.loads(number)
    session.write_text(json.dumps(doc))
    with pytest.raises(BisectError, match="round .* is not a number"):
        parse_session(session.read_text())
    p = cli("bisect", "--session", session, "--result", "good")
    assert p.returncode == 2 and p.stdout == "" and "is not a number" in p.stderr and "Traceback" not in p.stderr
