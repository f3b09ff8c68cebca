"""Megatron-LM's rerun state machine lines (tests/fixtures/megatron_rerun/, real message texts): each
outcome read as the verdict the suspect label uses, with its iteration, rank, node and device, and a
rejected NaN/Inf's outcome as the incident's ``nonfinite_message``; read beside any format, no line claimed."""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_agent.model import NONFINITE_MESSAGE, RERUN_VERDICT
from precision_agent.readers.parsers import Block, CompositeParser

FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron_rerun"


def read(name: str, fmt: str = "auto") -> list[tuple[int, int | None, str, dict]]:
    parser = CompositeParser(fmt)
    records = parser.parse(Block((FIXTURES / name).read_text()))
    assert not parser.errors
    return [(r.line, r.step, m, dict(a)) for r in records for m, _v, a in r.values
            if m in (RERUN_VERDICT, NONFINITE_MESSAGE) and r.producer == "megatron_rerun"]


def verdicts(rows) -> list[tuple[int, int | None, str, str | None]]:
    return [(line, step, a["verdict"], a.get("rank")) for line, step, m, a in rows if m == RERUN_VERDICT]


@pytest.mark.parametrize("fmt", ["auto", "megatron"])
def test_transient_first_rerun(fmt):
    rows = read("validate_transient.log", fmt)
    assert verdicts(rows) == [(4, 1235, "detected", "3"), (6, 1235, "transient", "3"), (7, 1235, "transient", "3")]
    detected = rows[0][3]
    assert detected["result"] == "tensor(nan, device='cuda:3')"
    assert detected["message"] == "found NaN in local forward loss calculation"
    transient = rows[1][3]
    assert (transient["node"], transient["device"]) == ("gpu-node-a", "3")
    # the incident: once, at the outcome, beside the verdict noted first
    assert [(line, step, a) for line, step, m, a in rows if m == NONFINITE_MESSAGE] == \
        [(6, 1235, {"what": "loss", "rerun_verdict": "transient"})]


def test_second_rerun_on_another_gpu_reproducible_is_the_numerics_verdict():
    rows = read("second_rerun_reproducible.log")
    assert verdicts(rows) == [(2, 88021, "detected", "5"), (3, 88021, "reproducible", "5"),
                              (4, 88021, "reproducible", "5")]
    assert rows[3][3]["node"] == "gpu-node-b"
    assert [a["what"] for _l, _s, m, a in rows if m == NONFINITE_MESSAGE] == ["loss"]


def test_first_release_lines_take_the_iteration_of_the_detection():
    rows = read("older_release.log")
    # "First rerun ... reproducible" carries neither rank nor iteration: the detection's, and [rank2]:
    assert verdicts(rows) == [(1, 4411, "detected", "2"), (3, 4411, "reproducible_same_gpu", "2")]
    assert rows[-1][2] == NONFINITE_MESSAGE and rows[-1][3]["rerun_verdict"] == "reproducible_same_gpu"


def test_reruns_disabled_the_detection_is_the_incident():
    rows = read("disabled.log")
    assert verdicts(rows) == [(1, 7001, "detected", "1")]
    assert rows[0][3]["node"] == "gpu-node-c"
    assert rows[1][2:] == (NONFINITE_MESSAGE, {"what": "local_grad_norm", "rerun_verdict": "detected"})


def test_tracker_file_statuses_in_both_enum_spellings():
    rows = read("tracker.txt")
    assert verdicts(rows) == [(1, 1235, "detected", "3"), (2, 1235, "transient", "3")]
    assert rows[1][3]["result"] == "2.4087" and rows[1][3]["message"] == "found NaN in local forward loss calculation"
    assert [m for *_x, m, _a in rows].count(NONFINITE_MESSAGE) == 0  # the result is finite on the rerun's line


def test_finite_rejections_are_verdicts_not_nonfinite_incidents():
    text = ("[rank0]:ERROR:megatron.core.rerun_state_machine:Unexpected result 41.5 on rank 0 at iteration #900 "
            "invocation #1 (message='Spiky loss')\n"
            "[rank0]:WARNING:megatron.core.rerun_state_machine:Rank 0, node n1, device 0, iteration #900: First "
            "rerun: unexpected result is not reproducible within the tolerance (2.1 != 41.5)!\n")
    parser = CompositeParser("megatron")
    values = [(m, dict(a).get("verdict")) for r in parser.parse(Block(text)) for m, _v, a in r.values]
    assert values == [(RERUN_VERDICT, "detected"), (RERUN_VERDICT, "transient")]


def test_claims_no_line_and_names_no_format():
    parser = CompositeParser("auto")
    text = (FIXTURES / "validate_transient.log").read_text()
    records = parser.parse(Block(text))
    assert parser.format == "megatron"            # the iteration line's producer, not the rerun reader
    assert any(r.producer == "megatron" and r.step == 1234 for r in records)
    assert parser.hint_records == sum(r.producer == "megatron_rerun" for r in records)
