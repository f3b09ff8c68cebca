"""`replay --json` on structured metric files written by the real writers (tests/fixtures/metricfiles):
the same JSON contract as for text logs, with the steps the file carries; the faulty runs page at
the planted step, the healthy ones page nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from support.commands import replay_json
from support.metricfiles import (HF_NAN_STEP, LIGHTNING_NAN_STEP, MEGATRON_INF_STEP, STEPS, csv_file,
                                 event_file)

FAULTY = {  # fixture: (file, format, first non-finite step)
    "hf_nan": (lambda: event_file("hf_nan"), "tfevents", HF_NAN_STEP),
    "megatron_nan": (lambda: event_file("megatron_nan"), "tfevents", MEGATRON_INF_STEP),
    "lightning_nan": (lambda: csv_file("lightning_nan"), "csv", LIGHTNING_NAN_STEP),
    "lightning_nan_tb": (lambda: event_file("lightning_nan"), "tfevents", LIGHTNING_NAN_STEP),
}
HEALTHY = {
    "hf_ok": (lambda: event_file("hf_ok"), "tfevents"),
    "megatron_ok": (lambda: event_file("megatron_ok"), "tfevents"),
    "lightning_ok": (lambda: csv_file("lightning_ok"), "csv"),
    "lightning_ok_tb": (lambda: event_file("lightning_ok"), "tfevents"),
}


def pages(r) -> list[dict]:
    return [f for f in r["findings"] if f["severity"] in ("page", "critical")]


@pytest.mark.parametrize("case", sorted(FAULTY))
def test_faulty_runs_page_at_the_planted_step(case):
    path, fmt, step = FAULTY[case]
    r = replay_json(path())
    assert r["format"] == fmt and r["records"] > 0
    first_page = pages(r)[0]
    assert first_page["rule"] == "TrainingNonFinite" and first_page["step"] == step, pages(r)
    assert r["nonfinite"][0]["step"] == step and r["nonfinite"][0]["line"] > 1


@pytest.mark.parametrize("case", sorted(HEALTHY))
def test_healthy_runs_page_nothing(case):
    path, fmt = HEALTHY[case]
    r = replay_json(path())
    assert r["format"] == fmt and r["records"] > 0
    assert pages(r) == [] and r["nonfinite"] == []
    assert r["steps"]["first"] in (0, 1) and r["steps"]["last"] >= STEPS - 1


def test_megatron_loss_scale_and_steps_from_the_event_file():
    r = replay_json(event_file("megatron_ok"))
    assert r["steps"] == {"first": 1, "last": STEPS}  # not the " vs samples" steps
    assert r["loss_scale"]["first"] == r["loss_scale"]["last"] == 65536.0
    assert r["loss_scaling"] == "yes"


def test_a_torn_and_damaged_file_says_so_on_stderr(tmp_path):
    data = bytearray(event_file("hf_ok").read_bytes())
    at = data.index(b"train/loss", len(data) // 2)
    data[at + len("train/loss") + 2] ^= 0x40  # the value of a loss record: its data CRC fails
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    path.write_bytes(bytes(data[:-5]))
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "replay", "--json", str(path)],
                          capture_output=True, text=True, timeout=120)
    r = json.loads(proc.stdout)
    assert proc.returncode == 0 and pages(r) == [] and r["records"] > 0
    assert "2 record(s) not read" in proc.stderr and "CRC" in proc.stderr and "torn" in proc.stderr


@pytest.mark.parametrize("name", ["metrics.csv", "events.out.tfevents.1.host.1.0"])
def test_a_file_with_no_mapped_name_is_said_with_its_names_and_exits_2(tmp_path, name):
    path = tmp_path / name
    if name == "metrics.csv":
        path.write_bytes(b"epoch,step,acc\n0,1,0.5\n0,2,0.6\n")
    else:  # the real HF file with its tags renamed out of the map (same lengths; CRCs recomputed)
        from support.metricfiles import records
        from precision_agent.readers import tfrecord
        renamed = [r[12:-4].replace(b"train/", b"trn_x/").replace(b"eval/", b"evl_x") for r in
                   records(event_file("hf_ok"))]
        path.write_bytes(b"".join(tfrecord.frame(r) for r in renamed))
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "replay", "--json", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    r = json.loads(proc.stdout)
    assert r["records"] == 0 and r["unrecognized"]["sample"]
    assert "none is mapped" in proc.stderr and "PRECISION_AGENT_METRIC_MAP" in proc.stderr
    assert ("epoch, step, acc" if name == "metrics.csv" else "trn_x/loss") in proc.stderr


def test_a_persisting_fault_is_one_line_of_the_text_report_and_every_finding_in_json():
    """A NaN that stays for the rest of the run is one finding per record (``--json`` keeps each)
    but one line of the readable report per rule and fault: the first, with how many more and
    where the last one is."""
    path = csv_file("lightning_nan")
    doc = replay_json(path)
    pages = [f for f in doc["findings"] if f["severity"] == "page"]
    assert len(pages) > 1
    out = subprocess.run([sys.executable, "-m", "precision_agent", "replay", str(path)],
                         capture_output=True, text=True, timeout=120).stdout
    shown = [ln for ln in out.splitlines() if ln.lstrip().startswith("[page]")]
    faults = {}   # one line per fault (the summary, its step aside), in the order of the first
    for f in pages:
        faults.setdefault(re.sub(r" at step \d+", "", f["summary"]), []).append(f)
    assert len(shown) == len(faults) < len(pages), out
    for line, same in zip(shown, faults.values()):
        first, last = same[0], same[-1]
        assert f"line {first['line']} step {first['step']}: {first['summary']}" in line
        assert f"and {len(same) - 1} more, the last at line {last['line']}, step {last['step']}" in line, out
