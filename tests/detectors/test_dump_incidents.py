"""Dump incidents (agent/detectors/dump_incident.py) through a real pipeline and the shipped rules:
one alert per incident of a run, the origin across ranks, a new incident after a restart or after
``clean_steps`` clean steps; and the same on real msprobe dumps (tests/fixtures/msprobe_incidents,
made by its make.py with real msprobe), scanned directory by directory as the daemon does."""

from __future__ import annotations

from pathlib import Path

import pytest

from precision_agent.dumps.samples import result_samples
from precision_agent.dumps.scan import scan_dump
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import default_rules_dir, load_rules
from precision_agent.model import AlertState, DUMP_NONFINITE, DUMP_STEP, Sample, SourcePos, make_labels
from precision_agent.readers.runs import dump_run_labels

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "msprobe_incidents"
T0 = 1_700_000_000.0


def _pipeline() -> Pipeline:
    return Pipeline(load_rules([default_rules_dir()]), keep_findings=10_000)


def _dump(step: int, rank: int | None, op: str | None, order: int = 0, *, unit: str | None = None,
          written: float | None = None, run: str = "r") -> list[Sample]:
    """What the scan of one (step, rank) dump directory gives: its first bad op (if any) and its marker."""
    labels = make_labels({"run": run}, **({"rank": str(rank)} if rank is not None else {}))
    src = SourcePos(unit or f"/d/{run}/step{step}/rank{rank}", 0)
    w = (("written", written),) if written is not None else ()
    out = []
    if op is not None:
        out.append(Sample(labels, DUMP_NONFINITE, 1.0, step, src, T0 + step, None,
                          (("op", op), ("tensor", "output[0]"), ("rank", rank), ("nonfinite", 1), ("order", order), *w)))
    out.append(Sample(labels, DUMP_STEP, float(op is not None), None, src, T0 + step, None,
                      (("step", step), ("rank", rank), ("nonfinite", op is not None), ("overflow", False), *w)))
    return out


def _nonfinite(p: Pipeline) -> list:
    return sorted((a for a in p.alerts.alerts.values() if a.rule == "DumpNonFinite"), key=lambda a: a.active_at)


def test_a_nan_that_persists_on_two_ranks_is_one_alert_naming_its_origin() -> None:
    p = _pipeline()
    for step in range(3, 13):   # rank 0's dumps are scanned first; rank 1 went first in execution order
        later = "Functional.mse_loss.0.backward" if step > 3 else None
        p.process(_dump(step, 0, later or "Distributed.all_reduce.0.forward", order=40 if step == 3 else 50))
        p.process(_dump(step, 1, later or "Torch.matmul.0.forward", order=12 if step == 3 else 50))
    (a,) = _nonfinite(p)
    assert dict(a.labels) == {"run": "r", "incident": "1", "severity": "page", "suspect": "unknown"}   # no op, no rank
    ev = a.finding["evidence"]
    assert (a.finding["step"], ev["origin_rank"], ev["op"]) == (3, "1", "Torch.matmul.0.forward")
    assert ev["affected_steps"] == list(range(3, 13)) and ev["affected_steps_total"] == 10
    assert {o["op"] for o in ev["later_ops"]} == {"Distributed.all_reduce.0.forward", "Functional.mse_loss.0.backward"}
    assert "Torch.matmul.0.forward" in a.annotations["summary"] and "rank 1" in a.annotations["summary"]
    assert a.count == 20 and a.state == AlertState.FIRING


def test_ranks_tied_on_step_and_op_are_all_named() -> None:
    p = _pipeline()
    p.process(_dump(5, 1, "Torch.matmul.0.forward", order=7))
    p.process(_dump(5, 0, "Torch.matmul.0.forward", order=7))
    p.process(_dump(5, 2, "Functional.softmax.0.forward", order=9))
    (a,) = _nonfinite(p)
    assert a.finding["evidence"]["origin_rank"] == "1,0" and a.finding["evidence"]["op"] == "Torch.matmul.0.forward"


def test_an_earlier_step_scanned_later_becomes_the_origin() -> None:
    p = _pipeline()
    p.process(_dump(6, 0, "Functional.mse_loss.0.backward"))
    p.process(_dump(4, 1, "Torch.matmul.0.forward"))
    (a,) = _nonfinite(p)
    ev = a.finding["evidence"]
    assert (a.finding["step"], ev["origin_rank"], ev["op"]) == (4, "1", "Torch.matmul.0.forward")
    assert ev["later_ops"] == [{"op": "Functional.mse_loss.0.backward", "step": 6, "rank": "0"}]


def test_a_restart_into_the_same_dump_root_is_a_new_incident() -> None:
    p = _pipeline()
    for step in range(0, 6):
        p.process(_dump(step, None, "Torch.matmul.0.forward" if step >= 3 else None,
                        unit=f"/d/r/step{step}/proc100", written=T0 + step))
    for step in range(2, 6):    # the restart from the step-2 checkpoint, a new process
        p.process(_dump(step, None, "Torch.matmul.0.forward" if step >= 4 else None,
                        unit=f"/d/r/step{step}/proc200", written=T0 + 100 + step))
    first, second = _nonfinite(p)
    assert first.state == AlertState.RESOLVED and second.state == AlertState.FIRING
    assert dict(second.labels)["incident"] == "2" and second.finding["step"] == 4
    assert second.finding["evidence"]["affected_steps"] == [4, 5]


def test_a_late_scan_of_an_earlier_step_is_no_restart() -> None:
    p = _pipeline()
    p.process(_dump(5, 0, "Torch.matmul.0.forward", written=T0 + 5))
    p.process(_dump(4, 1, None, written=T0 + 4))          # rank 1's step 4, written before: scanned late
    p.process(_dump(6, 0, "Functional.mse_loss.0.backward", written=T0 + 6))
    (a,) = _nonfinite(p)
    assert a.state == AlertState.FIRING and a.finding["evidence"]["affected_steps"] == [5, 6]


def test_clean_steps_end_the_incident_and_the_next_nan_pages_again() -> None:
    p = _pipeline()
    p.process(_dump(3, 0, "Torch.matmul.0.forward"))
    p.process(_dump(4, 0, None))
    p.process(_dump(5, 0, None))
    (a,) = _nonfinite(p)
    assert a.state == AlertState.FIRING          # 2 clean steps of the shipped 3
    p.process(_dump(6, 0, None))
    assert a.state == AlertState.RESOLVED
    p.process(_dump(9, 0, "Functional.softmax.0.forward"))
    _, b = _nonfinite(p)
    assert dict(b.labels)["incident"] == "2" and b.finding["step"] == 9 and b.state == AlertState.FIRING


def test_two_runs_are_two_incidents() -> None:
    p = _pipeline()
    p.process(_dump(2, 0, "Torch.matmul.0.forward", run="job_a"))
    p.process(_dump(3, 0, "Torch.matmul.0.forward", run="job_b"))
    p.process(_dump(4, 0, "Functional.mse_loss.0.backward", run="job_a"))
    assert sorted(dict(a.labels)["run"] for a in _nonfinite(p)) == ["job_a", "job_b"]


# -- real msprobe dumps ------------------------------------------------------------------------------
def _units(root: Path) -> list[Path]:
    """The rank/proc directories of a dump root in the order a training writes them (step, rank)."""
    units = [d.parent for d in root.rglob("dump.json")]
    return sorted(units, key=lambda u: (int(u.parent.name.removeprefix("step")), u.name))


def _feed(p: Pipeline, watched: Path, root: Path, written0: float = T0, run: str | None = None) -> None:
    for i, unit in enumerate(_units(root)):
        labels = dump_run_labels(str(unit), str(watched), "file", {"run": run} if run else {})
        samples = result_samples(scan_dump(unit), {}, str(unit))
        for s in samples:
            if s.metric in (DUMP_NONFINITE, DUMP_STEP):
                s.attrs += (("written", written0 + i),)
            s.labels = make_labels({**labels, **dict(s.labels)})
        p.process(samples)


needs_fixtures = pytest.mark.skipif(not (FIXTURES / "nan_2ranks").is_dir(), reason="fixtures not generated")


@needs_fixtures
def test_real_msprobe_nan_on_two_ranks_is_one_incident() -> None:
    p = _pipeline()
    _feed(p, FIXTURES, FIXTURES / "nan_2ranks")
    (a,) = _nonfinite(p)
    ev = a.finding["evidence"]
    assert dict(a.labels)["run"] == "nan_2ranks"
    assert (a.finding["step"], ev["origin_rank"]) == (3, "1") and ev["op"].startswith("Torch.matmul."), ev
    assert ev["affected_steps"] == list(range(3, 13)), ev


@needs_fixtures
def test_real_msprobe_restart_pages_again() -> None:
    p = _pipeline()
    # one dump root in the job (the daemon test copies both into one folder): the watch's run label
    _feed(p, FIXTURES / "restart", FIXTURES / "restart" / "attempt1", run="job")
    _feed(p, FIXTURES / "restart", FIXTURES / "restart" / "attempt2", T0 + 1000, run="job")
    first, second = _nonfinite(p)
    assert (first.finding["step"], second.finding["step"]) == (3, 4)
    assert first.state == AlertState.RESOLVED and dict(second.labels)["incident"] == "2"


# -- comparisons (agent/compare/live.py compare_sample) ------------------------------------------------
def _divergence(p: Pipeline) -> list:
    return sorted((a for a in p.alerts.alerts.values() if a.rule == "DumpDivergence"), key=lambda a: a.active_at)


def test_diverging_comparisons_of_two_ranks_are_one_incident() -> None:
    """Each rank's comparison carries its rank: rank 1's step 1 after rank 0's step 1 is another
    rank, not the same step dumped again by a restarted run."""
    from precision_agent.compare.live import compare_sample
    p = _pipeline()
    for step in (1, 2):
        for rank in (0, 1):
            where = {"op": "Torch.matmul.0.forward", "step": step, "rank": rank, "tensor": "output[0]"}
            res = {"diverged": True, "mode": "benchmark", "first_diverging_op": where, "step": step}
            p.process([compare_sample(res, {"run": "r"}, f"/d/r/step{step}/rank{rank}")])
    (a,) = _divergence(p)
    assert a.state == AlertState.FIRING and dict(a.labels)["incident"] == "1"
    assert a.finding["evidence"]["origin_ranks"] == ["0", "1"] and a.finding["evidence"]["affected_steps"] == [1, 2]


def test_without_write_times_another_directory_at_the_same_step_is_no_restart() -> None:
    p = _pipeline()
    p.process(_dump(3, None, "Torch.matmul.0.forward", unit="/d/r/step3/rank0"))
    p.process(_dump(3, None, "Torch.matmul.0.forward", unit="/d/r/step3/rank1"))   # no rank attr, no time
    p.process(_dump(2, None, None, unit="/d/r/step2/rank1"))
    (a,) = _nonfinite(p)
    assert a.state == AlertState.FIRING and dict(a.labels)["incident"] == "1"
