"""`scan` on CANN trees: step and rank from the directory layout, Opdebug files decoded into
overflow entries and DumpOverflow findings, fp16 saturation judged by its rule (with its
threshold), findings from the daemon's own samples, ``--rules`` and the progress bar."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from support import dumps as W
from precision_agent.dumps.cann import dump_dir_location
from precision_agent.commands.scan import scan
from precision_agent.dumps.scan import scan_dump
from precision_agent.dumps.samples import result_samples
from precision_agent.model import DUMP_FP16_SATURATED, DUMP_NONFINITE, DUMP_OVERFLOW
from precision_agent.engine.rulefile import load_rules
from support.dumps import opdebug_two_ranks_two_steps as _two_ranks_two_steps

TS = 1_709_294_400_000_000
ONE = np.ones((2, 3), np.float16)
INF = np.array([1.0, np.inf, 2.0], np.float16)
SAT = np.array([65504.0, -65504.0, 1.0], np.float16)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precision_agent", "scan", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("path, expected", [
    ("/d/dump/20220217095546/3/ge_default_20220217095547_1/1/0", (0, 3)),       # GE/ACL model dump
    ("/d/dump/20220217095546/3", (None, 3)),                                    # single-op dump
    ("/d/rank_2/20240101010101/step_5/20240101010102/1/net/1/7", (5, 2)),       # msprobe ACL
    ("/d/rank_1/resnet/0/12", (12, 1)),                                         # MindSpore O0/O1
    ("/d/some/dir", (None, None)),
    ("/d/dump/20220217095546/x", (None, None)),                                 # not a device id
])
def test_dump_dir_location(path, expected):
    assert dump_dir_location(path) == expected


def test_cann_tree_steps_ranks_and_overflows(tmp_path):
    d = _two_ranks_two_steps(tmp_path)
    r = scan(tmp_path)
    assert r["layout"] == "cann" and r["errors"] == []
    assert {(t["step"], t["rank"]) for t in r["tensors"]} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert r["first_nonfinite"] == {"step": 1, "rank": 0, "op": "add", "tensor": "output[0]", "by": "op"}
    first, second = r["overflows"]
    assert {k: first[k] for k in ("step", "rank", "op", "op_type", "task_id", "stream_id", "accelerator",
                                  "status", "record")} == {
        "step": 1, "rank": 0, "op": "add", "op_type": "Add", "task_id": 11, "stream_id": 0,
        "accelerator": "AI Core", "status": "float_overflow", "record": "new"}
    assert first["file"].startswith(d) and ".add.11.0." in first["file"]
    assert first["debug_file"].endswith(W.opdebug_name(9, 0, TS + 1005))
    assert (second["op"], second["accelerator"], second["status"]) == ("cast", "DHA Atomic Add", "underflow")
    by_rule = {}
    for f in r["findings"]:
        by_rule.setdefault(f["rule"], []).append(f)
    assert [(f["op"], f["step"], f["rank"]) for f in by_rule["DumpNonFinite"]] == [("add", 1, 0)]
    # per_step: 1 in the shipped rule: only the earliest overflow of the step alerts
    (ovf,) = by_rule["DumpOverflow"]
    assert (ovf["op"], ovf["step"], ovf["severity"]) == ("add", 1, "ticket")
    assert ovf["evidence"]["status"] == "float_overflow" and "AI Core" in ovf["summary"]
    assert "DumpFp16Saturation" not in by_rule
    # --step keeps that step's tensors and overflows only
    r0 = scan(tmp_path, step=0)
    assert r0["overflows"] == [] and r0["first_nonfinite"] is None and r0["findings"] == []


def test_corrupt_opdebug_is_reported_and_the_scan_goes_on(tmp_path):
    d = W.ge_step_dir(str(tmp_path), 0, 3)
    W.write_ops(d, [("Add", "add", 11, [ONE], [ONE])], TS)
    W.write_opdebug(f"{d}/{W.opdebug_name(9, 0, TS + 5)}", W.old_record(
        {"AI Core": {"stream_id": 0, "task_id": 11, "status": 0x20}}))
    with open(f"{d}/{W.opdebug_name(9, 0, TS + 1)}", "wb") as fh:
        fh.write(b"\x04\x00\x00\x00\x00\x00\x00\x00\xff\xff")          # header runs past the end
    W.write_opdebug(f"{d}/{W.opdebug_name(9, 0, TS + 2)}", b"\x00" * 100)  # neither record layout
    W.write_opdebug(f"{d}/{W.opdebug_name(9, 0, TS + 3)}", W.old_record(
        {"AI Core": {"stream_id": 0, "task_id": 999, "status": 0x400}}))  # no dump file for task 999
    r = scan_dump(tmp_path)
    assert len(r["errors"]) == 2 and all("Opdebug" in e["path"] for e in r["errors"])
    assert [(o["op"], o["status"]) for o in r["overflows"]] == [
        (None, "cube_accumulation_overflow"), ("add", "float_overflow")]
    (s1, s2) = [s for s in result_samples(r, {"job": "j"}) if s.metric == DUMP_OVERFLOW]
    assert s1.attr("op") == "task999_stream0" and dict(s1.labels) == {"job": "j", "rank": "0"}
    assert s1.step == 3 and s2.attr("op") == "add"


def _saturated_step(root):
    d = W.ge_step_dir(str(root), 0, 7)
    few = np.array([65504.0, 1.0], np.float16)                          # 1 saturated value
    W.write_ops(d, [("MatMul", "mm", 1, [ONE], [few]),
                    ("Mul", "mul", 2, [SAT], [SAT]),                    # 2 saturated outputs
                    ("Add", "add", 3, [SAT], [SAT])], TS)
    return d


def test_fp16_saturation_rule_and_threshold(tmp_path):
    _saturated_step(tmp_path / "dump")
    r = scan(tmp_path / "dump")
    sat = [f for f in r["findings"] if f["rule"] == "DumpFp16Saturation"]
    assert [(f["op"], f["step"], f["evidence"]["saturated"]) for f in sat] == [("mm", 7, 1)]  # first per step
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "sat.yml").write_text(
        "groups:\n- name: g\n  rules:\n  - alert: Sat2\n    kind: fp16_saturation\n"
        "    params: {min_count: 2}\n    labels: {severity: info}\n")
    r2 = scan(tmp_path / "dump", rules=load_rules([rules]))
    assert [(f["rule"], f["op"], f["tensor"]) for f in r2["findings"]] == [("Sat2", "mul", "output[0]")]
    # the scan's findings come from the daemon's samples: the same ones, in the same order
    samples = result_samples(r, {})
    assert [s.attr("op") for s in samples if s.metric == DUMP_FP16_SATURATED] == ["mm", "mul", "add"]
    assert not [s for s in samples if s.metric in (DUMP_NONFINITE, DUMP_OVERFLOW)]


def test_cli_rules_option_progress_and_json(tmp_path):
    _saturated_step(tmp_path / "dump")
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "none.yml").write_text("groups: []\n")
    quiet = cli("--json", str(tmp_path / "dump"), "--rules", str(rules))
    assert quiet.returncode == 0 and "scanning [" not in quiet.stderr     # stderr is not a tty here
    assert json.loads(quiet.stdout)["findings"] == []
    shown = cli("--json", "--progress", str(tmp_path / "dump"))
    assert shown.returncode == 0 and "scanning [" in shown.stderr and "6/6 tensors" in shown.stderr
    r = json.loads(shown.stdout)                                          # stdout stays pure JSON
    assert {"tensors", "first_nonfinite", "findings", "overflows"} <= set(r)
    assert [f["rule"] for f in r["findings"]] == ["DumpFp16Saturation"]
    (rules / "bad.yml").write_text("groups:\n- name: g\n  rules:\n  - alert: X\n    kind: no_such_kind\n")
    bad = cli(str(tmp_path / "dump"), "--rules", str(rules))
    assert bad.returncode == 2 and "no_such_kind" in bad.stderr
    text = cli(str(tmp_path / "dump"), "--no-progress").stdout
    assert "findings: 1" in text and "DumpFp16Saturation step 7" in text and "overflows: 0" in text


def test_scan_thread_samples_take_the_watch_labels(tmp_path):
    from precision_agent.dumps.samples import labelled
    from precision_agent.dumps.schedule import DumpScheduler
    from conftest import wait_for
    d = _two_ranks_two_steps(tmp_path)
    sched = DumpScheduler(settle=0.0, queue_size=1, scanned={})
    sched.queue.put_nowait((d, (1, 1, 1)))
    sched.start()
    try:
        wait_for(lambda: sched.inbox, what="scan result")
    finally:
        sched.stop()
    (r,) = sched.drain()
    assert r.error is None and [s.metric for s in r.samples][:2] == [DUMP_NONFINITE, DUMP_OVERFLOW]
    samples = labelled(r.samples, {"job": "llm", "rank": "99"})
    assert {dict(s.labels)["rank"] for s in samples} == {"0"}          # the dump's own rank wins
    assert all(dict(s.labels)["job"] == "llm" for s in samples)
