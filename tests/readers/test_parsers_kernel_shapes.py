"""The ``kernel`` log format in every shape the kernel log reaches a file in (tests/fixtures/kernel,
with their sources): the time each fault happened (true UTC seconds: an offset on the line wins, a
zone-less wall clock is the host's zone, a syslog stamp's year is the one that is not in the
future, boot-relative stamps give no wall time but say so), and the Ascend NPU driver's faults."""

from __future__ import annotations

import calendar
import time

import pytest

from conftest import REPO
from precision_agent.model import HW_FAULT
from precision_agent.readers import faultcodes
from precision_agent.readers.logstream import LogStream
from precision_agent.readers.parsers import Block, CompositeParser, kernel_time

FIXTURES = REPO / "tests" / "fixtures" / "kernel"
NOW = calendar.timegm((2026, 11, 28, 7, 55, 0))   # what "now" is for a syslog stamp's year
XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=7, name=python, GPU has fallen off the bus."


@pytest.fixture
def zone(monkeypatch):
    """Set the host's zone (TZ) and the clock for the duration of a test."""
    def set_zone(tz: str, now: float = NOW) -> None:
        monkeypatch.setenv("TZ", tz)
        time.tzset()
        monkeypatch.setattr(kernel_time, "_clock", lambda: now)
    yield set_zone
    monkeypatch.undo()
    time.tzset()


def faults(text: str, fmt: str = "kernel") -> list[dict]:
    parser = CompositeParser(fmt)
    out = [{"line": rec.line, "time": rec.log_time, **dict(attrs)}
           for rec in parser.parse(Block(text)) for metric, _, attrs in rec.values if metric == HW_FAULT]
    assert not parser.errors
    return out


def utc(*args: int) -> float:
    return float(calendar.timegm((*args, 0, 0, 0)[:9]))


def test_each_fixture_shape_reads_the_time_of_its_faults(zone):
    zone("Asia/Shanghai")   # +08:00 without daylight saving: a naive-as-UTC reading would be 8 h off
    def times(name: str) -> list[tuple]:
        return [(f["line"], f["time"], f["time_basis"], f.get("uptime")) for f in faults((FIXTURES / name).read_text())]
    # syslog: host zone, year from now (May is before November: this year)
    assert times("kern.log")[0] == (4, utc(2026, 5, 18, 11, 2, 39), "local", 8721.06182)
    assert times("journal-short-precise.txt")[0] == (3, pytest.approx(utc(2026, 5, 18, 11, 2, 39) + 0.06182), "local", None)
    # the offset on the line wins over the host's zone
    assert times("journal-short-iso.txt")[0] == (2, utc(2026, 5, 18, 7, 14, 51), "offset", None)
    assert times("messages-rfc3339.txt") == [
        (2, pytest.approx(utc(2020, 12, 30, 16, 39, 26) + 0.101322), "offset", 21202266.129771),
        (3, pytest.approx(utc(2024, 5, 18, 19, 2, 39) + 0.06182), "offset", None)]
    assert times("dmesg-iso.txt") == [(2, pytest.approx(utc(2025, 5, 27, 4, 18, 56) + 0.089671), "offset", None),
                                      (3, pytest.approx(utc(2025, 5, 27, 4, 18, 57) + 0.101204), "offset", None)]
    # journal export / json: the entry's __REALTIME_TIMESTAMP (µs), __MONOTONIC_TIMESTAMP as uptime
    assert times("journal-export.txt") == [(11, 1716058959.06182, "epoch", 8721.06182),
                                           (23, 1716058959.061901, "epoch", 8721.061901)]
    assert [t[1:3] for t in times("journal.json")] == [(1716058959.06182, "epoch"), (1716058959.061901, "epoch")]
    # dmesg -T: host zone; raw dmesg and /dev/kmsg: uptime only, no wall time made up
    assert times("dmesg.txt") == [(2, utc(2024, 8, 30, 3, 43, 9), "local", None), (3, utc(2024, 8, 30, 3, 43, 9), "local", None),
                                  (4, utc(2024, 8, 30, 3, 43, 14), "local", None), (5, None, "uptime", 93297.027938),
                                  (6, None, "uptime", 1204.123584)]
    assert times("kmsg.txt") == [(2, None, "uptime", 8721.06182), (3, None, "uptime", 8721.061901),
                                 (4, None, "uptime", 8721.062004)]


@pytest.mark.parametrize("stamp, now, expected", [
    ("Dec 31 23:59:58", utc(2027, 1, 1, 0, 0, 5), utc(2026, 12, 31, 23, 59, 58)),   # read in January: last year
    ("Jan  1 00:00:01", utc(2026, 12, 31, 23, 59, 0), utc(2027, 1, 1, 0, 0, 1)),    # a clock a little ahead
    ("Nov 28 07:42:14", utc(2026, 11, 28, 7, 55), utc(2026, 11, 28, 7, 42, 14)),
    ("Feb 29 10:00:00", utc(2027, 3, 1), utc(2024, 2, 29, 10, 0, 0)),               # the last leap year
])
def test_a_syslog_stamp_takes_the_year_that_is_not_in_the_future(zone, stamp, now, expected):
    zone("UTC", now)
    (f,) = faults(f"{stamp} gpu-node-a kernel: [ 8721.061820] {XID}\n")
    assert (f["time"], f["time_basis"]) == (expected, "local")


def test_daylight_saving_and_zone_names(zone):
    zone("Europe/Berlin")
    (summer,) = faults(f"Jul  1 12:00:00 h kernel: {XID}\n")
    (winter,) = faults(f"Jan  2 12:00:00 h kernel: {XID}\n")
    assert summer["time"] == utc(2026, 7, 1, 10, 0, 0) and winter["time"] == utc(2026, 1, 2, 11, 0, 0)
    # journalctl -o short-full: UTC and the host's own zone name are known, another zone is not guessed
    (full,) = faults(f"Sat 2026-11-28 07:42:14 CET h kernel: {XID}\n")
    (full_utc,) = faults(f"Sat 2026-11-28 07:42:14 UTC h kernel: {XID}\n")
    (other,) = faults(f"Sat 2026-11-28 07:42:14 JST h kernel: {XID}\n")
    assert (full["time"], full["time_basis"]) == (utc(2026, 11, 28, 6, 42, 14), "local")
    assert (full_utc["time"], full_utc["time_basis"]) == (utc(2026, 11, 28, 7, 42, 14), "offset")
    assert (other["time"], other["time_basis"]) == (None, "none")


@pytest.mark.parametrize("line", [
    f"Feb 30 10:00:00 h kernel: {XID}", f"2026-13-01T00:00:00+00:00 h kernel: {XID}",
    f"2026-11-28T25:00:00+0800 h kernel: {XID}", f"2026-11-28T07:00:00+2500 h kernel: {XID}",
    f"[Fri Aug 30 11:63:09 2024] {XID}", f"0000-01-01T00:00:00Z h kernel: {XID}", f"{XID}",
    "{\"MESSAGE\":\"" + XID + "\"}",
])
def test_a_stamp_that_is_no_real_time_gives_none_and_says_so(zone, line):
    zone("UTC")
    (f,) = faults(line + "\n")
    assert f["time"] is None and f["time_basis"] == "none" and f["code"] == 79


def test_a_gpu_off_the_bus_without_its_xid_line():
    (f,) = faults((FIXTURES / "dmesg-off-bus.txt").read_text())   # the probe-time three-line message
    assert (f["line"], f["device"], f["code"], f["class"], f["inferred"]) == (1, "0000:b3:00", 79, "hardware", True)
    assert f["message"].startswith("NVRM: The NVIDIA GPU 0000:b3:00.0 NVRM: (PCI ID: 10de:26b5)")
    # its Xid 79 line close by (either side) makes it the same event; far away, another one
    near = f"NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n{XID}\n"
    assert [g.get("inferred", False) for g in faults(near)] == [False]
    far = "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n" + "x\n" * 20 + XID + "\n"
    assert [g.get("inferred", False) for g in faults(far)] == [True, False]
    assert faults("the GPU has fallen off the bus again\n", "auto") == []


def test_export_entries_do_not_lend_their_time_to_the_next_entry():
    text = "__REALTIME_TIMESTAMP=1716058959061820\nMESSAGE=hello\n\n_TRANSPORT=kernel\nMESSAGE=" + XID + "\n"
    (f,) = faults(text)
    assert f["time"] is None and f["time_basis"] == "none"


def test_ascend_driver_faults(zone):
    zone("UTC")
    got = faults((FIXTURES / "ascend-messages.txt").read_text())
    assert [(f["line"], f["vendor"], f["device"], f["code"], f["class"]) for f in got] == [
        (2, "ascend", "1", "0x40F84E00", "hardware"),     # the host lost the device's heartbeat
        (3, "ascend", "3", "0x80E01801", "hardware"),     # HBM multi-bit ECC
        (4, "ascend", "5", "0x80C98002", "application")]  # AI Core: bad input from the program
    # line 5 ("Event resume") is the fault clearing, line 6 (devmm "Vm fault failed") no device fault
    assert got[1]["severity"] == "Critical" and "HBM" in got[1]["meaning"]
    assert got[1]["message"].startswith("event_id=0x80e01801; device_id=3; node_type=0x70[HBM/3DRAM]")
    assert got[0]["message"].startswith("Heartbeat lost! (device=1;") and got[0]["uptime"] == 1197.584409
    assert got[1]["time"] == utc(2026, 8, 1, 9, 12, 40)
    # the other order of level and module, the newer heartbeat text, a code not in the catalogue
    other = faults("[ascend] [ERROR] [fault_manager] [dms_record_fault_event_log 1410] event_id=0x8abcdef0; "
                   "device_id=0; node_type=0x99[]; severity=1[Warning]; assertion=1[Event occur];\n"
                   "[  12.5] [ascend] [drv_soft_fault] [ERROR] [heart_beat_read 204] <kworker/1:0:7,7> Heartbeat lost! "
                   "(device_id=7; old_count=3; current_count=3; lost_count=4;)\n")
    assert [(f["device"], f["code"], f["class"], f["meaning"]) for f in other] == [
        ("0", "0x8ABCDEF0", "unknown", "fault 0x8ABCDEF0 (not in the fault-code catalogue)"),
        ("7", "0x40F84E00", "hardware", faultcodes.fault_codes(None)[("ascend", "0x40F84E00")].meaning)]


def test_ascend_lines_are_detected_and_prose_is_not():
    parser = CompositeParser("auto")
    parser.parse(Block((FIXTURES / "ascend-messages.txt").read_text()))
    assert parser.format == "kernel"
    for line in ("[ascend] [fault_manager] event_id is the fault code\n", "event_id=0x80e01801; device_id=3;\n",
                 "[ascend] [devmm] [ERROR] Vm fault failed. (hostpid=1; devid=0)\n",
                 "HBM MULTI BIT ECC, Uncorrectable ECC, device_id=3, event_id=0x80e01801, time us=67672363666.\n"):
        assert faults(line, "auto") == []


def test_users_extend_the_ascend_catalogue(tmp_path, monkeypatch):
    extra = tmp_path / "codes.yml"
    extra.write_text("ascend:\n  - {code: 0x8abcdef0, meaning: our board's fault, class: hardware}\n"
                     "  - {code: \"80C98002\", meaning: ours, class: unknown}\n")
    monkeypatch.setenv(faultcodes.ENV_EXTRA, str(extra))
    codes, why = faultcodes.current_codes()
    assert why is None and codes[("ascend", "0x8ABCDEF0")].cls == "hardware"
    assert codes[("ascend", "0x80C98002")].cls == "unknown"   # yours win, whatever the spelling
    extra.write_text("ascend:\n  - {code: 0xZZ, meaning: x, class: hardware}\n")
    faultcodes.fault_codes.cache_clear()
    codes, why = faultcodes.current_codes()
    assert why is not None and "32-bit hex" in why and codes[("ascend", "0x80E01801")].cls == "hardware"


@pytest.mark.parametrize("name, expected", [
    ("ascend-messages.txt", [(2, "0x40F84E00"), (3, "0x80E01801"), (4, "0x80C98002")]),
    ("journal-export.txt", [(11, 94), (23, 48)]),
    ("journal.json", [(1, 45), (2, 79)]),
])
def test_each_shape_followed_as_a_file(tmp_path, zone, name, expected):
    zone("UTC")
    log = tmp_path / name
    log.write_bytes((FIXTURES / name).read_bytes())
    stream = LogStream(str(log), {"host": "node-a"}, "kernel")
    try:
        samples = stream.poll(1 << 20) + stream.finish()
    finally:
        stream.close()
    assert [(s.source.line, s.attr("code")) for s in samples] == expected
    assert all(s.metric == HW_FAULT and s.log_time is not None and s.producer == "kernel" for s in samples)


def test_a_replayed_file_reads_syslog_years_against_its_mtime(tmp_path, zone):
    zone("UTC")
    log = tmp_path / "kern.log"
    log.write_text(f"Dec 31 23:59:58 h kernel: {XID}\nJan  1 00:00:03 h kernel: {XID}\n")
    mtime = utc(2024, 1, 1, 0, 0, 5)
    with kernel_time.reference_time(mtime):
        stream = LogStream(str(log), {}, "kernel")
        try:
            samples = stream.poll(1 << 20) + stream.finish()
        finally:
            stream.close()
    assert [s.log_time for s in samples] == [utc(2023, 12, 31, 23, 59, 58), utc(2024, 1, 1, 0, 0, 3)]
    assert faults(f"Dec 31 23:59:58 h kernel: {XID}\n")[0]["time"] == utc(2025, 12, 31, 23, 59, 58)   # now again
