"""The host ledger (agent/series/hardware.py): what it keeps of faults and rerun verdicts, the counter
behind precision_agent_hardware_faults_total, and its round trip through the stored memory (a
damaged row is refused, never half-restored)."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from precision_agent.model import HW_FAULT, LOSS, RERUN_VERDICT, Sample, SourcePos, make_labels
from precision_agent.series import hardware
from precision_agent.series.hardware import HostLedger, run_labels
from precision_agent.store.memory import decode, encode

T0 = 1_800_000_000.0


def fault(code: int, cls: str, at: float, device: str = "0000:3b:00", log_time: float | None = None) -> Sample:
    return Sample(make_labels({"job": "kern"}), HW_FAULT, 1.0, None, SourcePos("/var/log/kern.log", code), at,
                  log_time, (("vendor", "nvidia"), ("device", device), ("code", code), ("class", cls)), "kernel")


def rerun(verdict: str, it: int, at: float, rank: str = "3") -> Sample:
    return Sample(make_labels({"run": "r", "rank": rank}), RERUN_VERDICT, 1.0, it, SourcePos("/l/r.log", 9), at,
                  None, (("rank", rank), ("verdict", verdict)), "megatron_rerun")


def test_faults_by_read_time_stale_lines_never():
    led = HostLedger()
    led.note(fault(79, "hardware", T0))
    led.note(fault(48, "hardware", T0 + 5, log_time=T0 + 5 - 16 * 3600))   # 16 h old when read: backlog
    led.note(fault(94, "hardware", T0 + 6, log_time=T0 + 6 - 10 * 3600))   # a time zone away: not stale
    led.note(Sample(make_labels({"run": "r"}), LOSS, 1.0, 1, SourcePos("/l", 1), T0))   # not a ledger's sample
    assert [f.attr("code") for f in led.faults_between(T0 - 1, T0 + 10)] == [79, 94]
    assert [f.attr("code") for f in led.faults_between(T0 + 1, T0 + 10)] == [94]


def test_an_exact_stamp_hours_before_its_reading_is_backlog():
    """An offset or epoch stamp leaves no zone doubt: 2 h old when read is an old fault, not one of now;
    a zone-less one may be a zone away and counts."""
    def stamped(code: int, age: float, basis: str | None) -> Sample:
        f = fault(code, "hardware", T0, log_time=T0 - age)
        return replace(f, attrs=f.attrs + ((("time_basis", basis),) if basis else ()))
    led = HostLedger()
    for s in (stamped(79, 2 * 3600, "offset"), stamped(94, 120, "epoch"), stamped(48, 2 * 3600, None)):
        led.note(s)
    assert [f.attr("code") for f in led.faults_between(T0 - 1, T0 + 1)] == [94, 48]


def test_a_boot_relative_stamp_is_dated_by_this_hosts_uptime():
    """Raw dmesg / kmsg lines carry seconds since boot only: a line from minutes ago counts; one from
    hours ago, or from a boot before this one (later than the uptime), is backlog, never counted."""
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    read = time.time()

    def dmesg(code: int, uptime: float) -> Sample:
        f = fault(code, "hardware", read)
        return replace(f, attrs=f.attrs + (("time_basis", "uptime"), ("uptime", uptime)))
    led = HostLedger()
    led.note(dmesg(79, max(0.0, up - 30)))          # this boot, half a minute ago
    led.note(dmesg(48, up + 86400))                 # a boot before this one
    if up > 2 * 3600:
        led.note(dmesg(94, up - 2 * 3600))          # this boot, two hours ago
    assert [f.attr("code") for f in led.faults_between(read - 1, read + 1)] == [79]
    assert set(led.counts) == {("0000:3b:00", "79", "hardware")}


def test_counts_every_fault_by_device_code_class_bounded(monkeypatch):
    monkeypatch.setattr(hardware, "MAX_COUNTED", 3)
    led = HostLedger()
    for code, cls in ((13, "application"), (13, "application"), (79, "hardware"), (45, "application"),
                      (48, "hardware"), (63, "hardware")):
        led.note(fault(code, cls, T0))
    assert led.counts == {("0000:3b:00", "13", "application"): 2, ("0000:3b:00", "79", "hardware"): 1,
                          ("0000:3b:00", "45", "application"): 1, ("other", "other", "hardware"): 2}


def test_rerun_verdicts_once_per_outcome_and_matched_by_the_runs_labels():
    led = HostLedger()
    led.note(rerun("transient", 50, T0))
    led.note(rerun("transient", 50, T0 + 1))   # "Possible transient error!" after "First rerun: ...": one verdict
    led.note(rerun("transient", 50, T0 + 1, rank="4"))
    assert len(led.reruns) == 2
    assert len(list(led.reruns_of(make_labels({"run": "r", "rank": "0", "metric": "loss", "severity": "page"})))) == 2
    assert not list(led.reruns_of(make_labels({"run": "other", "metric": "loss"})))
    assert run_labels(make_labels({"run": "r", "rank": "1", "suspect": "unknown", "incident": "2"})) == (("run", "r"),)


def test_stored_and_restored_through_the_memory_codec():
    led = HostLedger()
    led.note(fault(79, "hardware", T0, log_time=T0 - 3))
    led.note(rerun("reproducible", 88021, T0 + 1))
    rows = led.rows(full=False)
    assert led.rows(full=False) is None and led.rows(full=True) == rows   # unchanged: nothing to write
    back = HostLedger()
    back.restore(decode(json.loads(json.dumps(encode(rows)))))
    assert list(back.faults) == list(led.faults) and list(back.reruns) == list(led.reruns)


@pytest.mark.parametrize("bad", [{"x": 1}, [["fault", "yesterday", None, None, [], [], "k:1"]],
                                 [["alien", T0, None, None, [], [], "k:1"]], [["fault", T0, None, None, [["a"]], [], ""]],
                                 [["rerun", T0, None, 1.5, [], [], ""]]])
def test_a_damaged_stored_row_is_refused_whole(bad):
    led = HostLedger()
    with pytest.raises(ValueError):
        led.restore(bad)
    assert not led.faults and not led.reruns
