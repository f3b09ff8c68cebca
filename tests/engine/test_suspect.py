"""The rows of the suspect verdict (agent/engine/suspect.py, docs/hardware.md), through the real
pipeline and the shipped rules: samples as the kernel, Megatron-rerun and training parsers make
them, read at the times given."""

from __future__ import annotations

import math

from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import default_rules_dir, load_rules
from precision_agent.model import (GRAD_NORM, HW_FAULT, LOSS, LOSS_SCALE, RERUN_VERDICT, AlertState, Sample,
                                   SourcePos, make_labels)

T0 = 1_800_000_000.0
RUN = {"job": "gpt", "run": "train"}


def pipeline() -> Pipeline:
    return Pipeline(load_rules([default_rules_dir()]))


def xid(code: int, cls: str, at: float, meaning: str = "", log_time: float | None = None) -> Sample:
    attrs = (("vendor", "nvidia"), ("device", "0000:3b:00"), ("code", code), ("class", cls),
             ("meaning", meaning or f"Xid {code}"), ("message", "..."))
    return Sample(make_labels({"job": "host-kernel"}), HW_FAULT, 1.0, None, SourcePos("/var/log/kern.log", 7),
                  at, log_time, attrs, "kernel")


def rerun(verdict: str, it: int, at: float, rank: str = "3") -> Sample:
    attrs = (("rank", rank), ("node", "gpu-node-a"), ("device", rank), ("result", "nan"), ("verdict", verdict))
    return Sample(make_labels(RUN), RERUN_VERDICT, 1.0, it, SourcePos("/logs/train.log", 40), at, None, attrs,
                  "megatron_rerun")


def value(metric: str, v: float, step: int, at: float, rank: str | None = None, line: int = 1) -> Sample:
    labels = make_labels(RUN, rank=rank) if rank is not None else make_labels(RUN)
    return Sample(labels, metric, v, step, SourcePos(f"/logs/train{rank or ''}.log", line), at, None, (), "megatron")


def healthy(p: Pipeline, steps: range, at: float, rank: str | None = None) -> None:
    for i in steps:
        p.process([value(LOSS, 2.5 - i / 1000, i, at + i, rank, i), value(GRAD_NORM, 1.0, i, at + i, rank, i)])


def nonfinite_alerts(p: Pipeline) -> list:
    return [a for a in p.alerts.alerts.values() if a.rule == "TrainingNonFinite"]


def nan_at(p: Pipeline, step: int, at: float) -> dict:
    p.process([value(LOSS, math.nan, step, at, line=step)])
    (alert,) = nonfinite_alerts(p)
    assert alert.state == AlertState.FIRING
    return alert


def test_hardware_xid_two_minutes_before_the_nan_is_hardware():
    p = pipeline()
    healthy(p, range(1, 50), T0)
    p.process([xid(79, "hardware", T0 + 60, "GPU has fallen off the bus")])
    alert = nan_at(p, 50, T0 + 180)
    assert dict(alert.labels)["suspect"] == "hardware"
    ev = alert.finding["evidence"]["suspect_evidence"]
    (fault,) = ev["faults"]
    assert fault["code"] == 79 and fault["device"] == "0000:3b:00" and fault["before_incident_s"] == 120.0
    assert ev["first_bad_step"] == 50
    assert "Xid 79" in alert.annotations["suspect"] and "fallen off the bus" in alert.annotations["suspect"]
    assert "hardware" in alert.annotations["description"]


def test_application_xid_alone_is_never_hardware():
    p = pipeline()
    healthy(p, range(1, 50), T0)
    p.process([xid(13, "application", T0 + 60), xid(43, "application", T0 + 61)])
    alert = nan_at(p, 50, T0 + 180)
    assert dict(alert.labels)["suspect"] == "unknown"
    ev = alert.finding["evidence"]["suspect_evidence"]
    assert [f["code"] for f in ev["not_hardware_faults"]] == [13, 43] and "faults" not in ev


def test_a_fault_outside_the_window_or_stale_decides_nothing():
    p = pipeline()
    p.suspects.window = 600.0
    healthy(p, range(1, 50), T0)
    p.process([xid(48, "hardware", T0 - 700)])                         # read 11+ min before
    p.process([xid(94, "hardware", T0 + 100, log_time=T0 + 100 - 3 * 86400)])  # a 3-day-old line read now
    alert = nan_at(p, 50, T0 + 120)
    assert dict(alert.labels)["suspect"] == "unknown"


def test_rerun_reproducible_on_another_gpu_is_numerics_even_beside_a_hardware_xid():
    p = pipeline()
    healthy(p, range(1, 50), T0)
    p.process([xid(79, "hardware", T0 + 100), rerun("detected", 50, T0 + 110), rerun("reproducible", 50, T0 + 119)])
    alert = nan_at(p, 50, T0 + 120)
    assert dict(alert.labels)["suspect"] == "numerics"
    ev = alert.finding["evidence"]["suspect_evidence"]
    assert {r["verdict"] for r in ev["reruns"]} == {"detected", "reproducible"} and ev["faults"]


def test_rerun_not_reproducible_is_hardware_and_same_gpu_reproducible_alone_is_unknown():
    p = pipeline()
    healthy(p, range(1, 50), T0)
    p.process([rerun("transient", 50, T0 + 119)])
    assert dict(nan_at(p, 50, T0 + 120).labels)["suspect"] == "hardware"

    q = pipeline()
    healthy(q, range(1, 50), T0)
    q.process([rerun("reproducible_same_gpu", 50, T0 + 119)])
    alert = nan_at(q, 50, T0 + 120)
    assert dict(alert.labels)["suspect"] == "unknown"
    assert "pending" in alert.annotations["suspect"]


def test_a_rerun_verdict_of_another_run_or_a_far_iteration_is_not_this_incidents():
    p = pipeline()
    healthy(p, range(1, 50), T0)
    other = rerun("reproducible", 50, T0 + 119)
    other.labels = make_labels({"job": "gpt", "run": "other"})
    p.process([other, rerun("transient", 5, T0 + 119)])
    assert dict(nan_at(p, 500, T0 + 120).labels)["suspect"] == "unknown"


def test_a_rerun_verdict_read_days_before_is_not_this_incidents():
    """The same run label and iteration weeks later (a rerun of the experiment under its old name):
    the old verdict does not decide the new incident."""
    p = pipeline()
    p.process([rerun("reproducible", 40, T0 - 3 * 86400)])
    healthy(p, range(1, 40), T0)
    assert dict(nan_at(p, 41, T0 + 120).labels)["suspect"] == "unknown"


def test_no_evidence_is_unknown_never_numerics():
    p = pipeline()
    healthy(p, range(1, 50), T0)
    alert = nan_at(p, 50, T0 + 120)
    assert dict(alert.labels)["suspect"] == "unknown"
    assert "no hardware fault" in alert.annotations["suspect"]


def bf16_ranks(p: Pipeline, ranks: dict[str, int]) -> None:
    """Ranks of one bf16 run (no loss scaling: a non-finite grad norm hits at once), healthy up to their step."""
    for r, last in ranks.items():
        p.process([Sample(make_labels(RUN, rank=r), "precision", 1.0, None, SourcePos(f"/logs/train{r}.log", 1), T0,
                          None, (("mode", "bf16"),), "hints")])
        healthy(p, range(1, last + 1), T0, r)


def test_grad_norm_nonfinite_on_one_rank_while_the_others_are_finite_at_that_step_is_hardware():
    p = pipeline()
    bf16_ranks(p, {"0": 22, "1": 21, "2": 22})
    p.process([value(GRAD_NORM, math.nan, 22, T0 + 40, "1", 22)])
    (alert,) = nonfinite_alerts(p)
    assert dict(alert.labels)["suspect"] == "hardware"
    single = alert.finding["evidence"]["suspect_evidence"]["single_rank"]
    assert single == {"rank": "1", "metric": "grad_norm", "step": 22, "finite_ranks": ["0", "2"],
                      "nonfinite_ranks": [], "decides": True}


def test_a_previous_attempts_ranks_are_not_this_attempts_witnesses():
    """An elastic restart with fewer ranks: ranks 2 and 3 of the first attempt reached step 40 and
    were never read again; in the second attempt (from step 20) rank 1's grad norm is NaN at step
    31 before rank 0 reports it. The stale ranks' finite values say nothing about step 31 now."""
    p = pipeline()
    bf16_ranks(p, {"0": 40, "1": 40, "2": 40, "3": 40})
    for r in ("0", "1"):
        healthy(p, range(20, 31), T0 + 200, r)        # steps back: a new attempt
    p.process([value(GRAD_NORM, math.nan, 31, T0 + 240, "1", 31)])
    (alert,) = nonfinite_alerts(p)
    assert dict(alert.labels)["suspect"] == "unknown"
    assert "single_rank" not in alert.finding["evidence"]["suspect_evidence"]
    p.process([value(GRAD_NORM, 1.0, 31, T0 + 241, "0", 31), value(GRAD_NORM, 1.0, 32, T0 + 242, "0", 32),
               value(GRAD_NORM, math.nan, 32, T0 + 243, "1", 32)])
    ev = alert.finding["evidence"]["suspect_evidence"]
    assert ev["single_rank"]["finite_ranks"] == ["0"]   # this attempt's rank is a witness


def test_this_attempts_ranks_witness_whatever_order_their_files_are_read_in():
    """A catch-up reads file after file: rank 0's restart and steps are read before rank 1's,
    and a previous attempt's rank 2 after both; rank 0 witnesses step 31, rank 2 does not."""
    p = pipeline()
    bf16_ranks(p, {"0": 40, "1": 40})
    healthy(p, range(20, 32), T0 + 400, "0")          # read before rank 1's restart was
    healthy(p, range(20, 31), T0 + 500, "1")
    healthy(p, range(1, 41), T0 + 600, "2")           # read last, its records ending at step 40
    p.process([value(GRAD_NORM, math.nan, 31, T0 + 700, "1", 31)])
    (alert,) = nonfinite_alerts(p)
    assert dict(alert.labels)["suspect"] == "hardware"
    assert alert.finding["evidence"]["suspect_evidence"]["single_rank"]["finite_ranks"] == ["0"]


def test_single_rank_evidence_that_arrives_later_is_shown_but_the_label_stays():
    p = pipeline()
    bf16_ranks(p, {"0": 20, "1": 20, "2": 20})
    p.process([value(GRAD_NORM, math.nan, 21, T0 + 30, "1", 21)])
    (alert,) = nonfinite_alerts(p)
    assert dict(alert.labels)["suspect"] == "unknown"  # the others have not reported step 21 yet
    for r in ("0", "2"):
        p.process([value(GRAD_NORM, 1.0, 21, T0 + 31, r, 21), value(GRAD_NORM, 1.0, 22, T0 + 32, r, 22)])
    p.process([value(GRAD_NORM, math.nan, 22, T0 + 40, "1", 22)])  # a later hit of the same alert
    assert len(nonfinite_alerts(p)) == 1 and dict(alert.labels)["suspect"] == "unknown"
    ev = alert.finding["evidence"]["suspect_evidence"]
    assert ev["fixed_at_firing"] == "unknown" and ev["verdict"] == "hardware"
    assert ev["single_rank"]["finite_ranks"] == ["0", "2"]
    assert alert.annotations["suspect"].startswith("unknown at firing; now hardware")


def test_one_ranks_loss_alone_is_listed_but_decides_nothing():
    p = pipeline()
    bf16_ranks(p, {"0": 22, "1": 21, "2": 22})
    p.process([value(LOSS, math.nan, 22, T0 + 40, "1", 22)])
    (alert,) = nonfinite_alerts(p)
    assert dict(alert.labels)["suspect"] == "unknown"   # its own batch: data or numerics as likely as a device
    assert alert.finding["evidence"]["suspect_evidence"]["single_rank"]["decides"] is False


def test_a_hardware_fault_read_after_the_firing_keeps_the_label_and_shows_in_the_evidence():
    p = pipeline()
    healthy(p, range(1, 50), T0)
    alert = nan_at(p, 50, T0 + 120)
    p.process([xid(79, "hardware", T0 + 121)])
    p.process([value(LOSS, math.nan, 51, T0 + 125, line=51)])
    assert len(nonfinite_alerts(p)) == 1                       # no second alert, no second page
    assert dict(alert.labels)["suspect"] == "unknown"
    assert alert.finding["evidence"]["suspect_evidence"]["faults"][0]["code"] == 79
    assert alert.annotations["suspect"].startswith("unknown at firing; now hardware: Xid 79")


def test_collapse_and_floor_are_judged_other_loss_scale_conditions_and_kinds_are_not():
    p = pipeline()
    p.process([xid(74, "hardware", T0, "NVLink error")])
    scale = 65536.0
    for i in range(1, 40):
        scale = scale / 2 if i > 20 and scale > 1 else scale
        p.process([value(LOSS_SCALE, scale, i, T0 + i, line=i), value(LOSS, 2.0, i, T0 + i, line=i)])
    judged = {a.rule: dict(a.labels).get("suspect") for a in p.alerts.alerts.values()}
    assert judged == {"LossScaleCollapse": "hardware", "LossScaleAtFloor": "hardware", "GpuHardwareFault": None}
    by_name = {r.name: r for r in p.rules.rules}
    assert not any(p.suspects.judges(by_name[n]) for n in ("LossScaleDecreasing", "LossScaleJump",
                                                          "LossScaleOverflowRatio", "TrainingLossSpike",
                                                          "GpuHardwareFault", "TrainingStalled"))
    assert all(p.suspects.judges(by_name[n]) for n in ("TrainingNonFinite", "TrainingLossDivergence", "DumpNonFinite",
                                                      "DumpOverflow", "DumpDivergence", "DumpNondeterminism"))


def test_stateful_incident_alerts_still_clear_with_their_suspect_label():
    p = pipeline()
    for i in range(1, 10):
        p.process([value(LOSS_SCALE, 2.0 ** (10 - i), i, T0 + i, line=i)])
    (collapse,) = [a for a in p.alerts.alerts.values() if a.rule == "LossScaleCollapse"]
    assert collapse.state == AlertState.FIRING and dict(collapse.labels)["suspect"] == "unknown"
    for i in range(11, 40):   # the scale grows again: the detector clears the state (labels without suspect)
        p.process([value(LOSS_SCALE, 2.0 ** min(i - 10, 12), i, T0 + i, line=i)])
    p.tick(T0 + 100)
    assert collapse.state == AlertState.RESOLVED
