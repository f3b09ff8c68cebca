"""Fuzz target of the kernel-log reader (``format: kernel``): every stamp shape it reads
(agent/readers/parsers/kernel_time.py) with random and out-of-range fields, NVIDIA Xid and Ascend
fault messages (tests/fixtures/kernel), mutated, glued, huge, binary, and journal export / JSON
entries, parsed in memory or followed from a file by the real reader. Every fault must come out
well formed; an unmutated stamp with an offset or an epoch must give exactly its time."""

from __future__ import annotations

import math
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

from precision_agent.readers.faultcodes import CLASSES
from precision_agent.readers.logstream import LogStream
from precision_agent.readers.parsers import Block, CompositeParser
from precision_agent.readers.parsers.kernel_time import BASES

from . import mutate
from .core import Target
from .mutate import mutate_bytes, mutate_text, pick

MESSAGES = [
    "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate.",
    "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, "
    "SM 0): Illegal Instruction Parameter",
    "NVRM: Xid (0000:01:00): 3, C 00000005 SC 00000007 M 00001ffc Data ffffffff",
    "NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000)",
    "[ascend] [ERROR] [drv_soft_fault] [heart_beat_judge 318] <kworker/5:1H:39365> Heartbeat lost! (device=1; "
    "old_count=1104; new_count=1104; lost_count=4; total_lost_count=4; total_10s_count=0; total_15s_count 0).",
    "[ascend] [fault_manager] [ERROR] [dms_record_fault_event_log 1410] event_id=0x80e01801; device_id=3; "
    "node_type=0x70[HBM/3DRAM]; node_id=0; sub_node_id=0; event_type=0x1[Uncorrectable ECC / other uncorrectable "
    "memory error. ]; severity=3[Critical]; assertion=1[Event occur]; description=[]; os_id=0; event_serial_num=12;",
    "[ascend] [fault_manager] [ERROR] [dms_record_fault_event_log 1410] event_id=0x80e01801; device_id=3; "
    "severity=3[Critical]; assertion=0[Event resume];",
    "IPv6: ADDRCONF(NETDEV_CHANGE): veth3c1e2f0: link becomes ready",
    "NVRM: GPU at 0000:01:00.0 has fallen off the bus.",
    "NVRM: The NVIDIA GPU 0000:b3:00.0\n               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
    "               NVRM: fallen off the bus and is not responding to commands.",
]
BAIT = ["NVRM: Xid (", "PCI:", "0000:", "3b:00", "): ", "79", ", ", "pid=", "name=", "[ascend] [", "[ERROR] ",
        "[fault_manager] ", "[drv_soft_fault] ", "event_id=0x", "device_id=", "; ", "assertion=", "severity=3[",
        "Heartbeat lost! (device=", "[ 1.5] ", "NVRM: The NVIDIA GPU ", "NVRM: (PCI ID: ",
        "fallen off the bus", " has fallen off the bus.", "9" * 30, "\t", '"', "\\", "{", "MESSAGE=", "\n\n"]
FRAGMENTS = BAIT + ["+08:00", "+0800", "Z", "-9999", "Feb 29 ", "Dec 31 23:59:60 ", "2026-13-45T99:99:99",
                    "__REALTIME_TIMESTAMP=", "99999999999999999999", ",", ";", "[", "]"]
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
EPOCH_MAX = 253402300800.0  # 10000-01-01: no wall time the reader gives may be later


def _fields(rng: random.Random) -> tuple[int, int, int, int, int, int, int]:
    """Year, month, day, hour, minute, second, microsecond: mostly real, sometimes out of range."""
    if rng.random() < 0.8:
        t = datetime(1971, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=rng.uniform(0, 2.5e9))
        return t.year, t.month, t.day, t.hour, t.minute, t.second, t.microsecond
    return (rng.choice((0, 1969, 1970, 2026, 9999, 10000)), rng.randint(0, 13), rng.randint(0, 32),
            rng.randint(0, 25), rng.randint(0, 61), rng.randint(0, 61), rng.randint(0, 999999))


def _stamped(rng: random.Random, msg: str) -> tuple[str, float | None]:
    """``msg`` behind a random stamp shape, and the exact time it must read as (None: not checked)."""
    y, mo, d, h, mi, s, us = _fields(rng)
    shape = rng.randrange(9)
    try:
        real = datetime(y, mo, d, h, mi, s, us, tzinfo=timezone.utc)
    except ValueError:
        real = None
    if shape == 0:   # offset: journalctl short-iso(-precise), rsyslog RFC 3339, dmesg iso
        off = rng.choice((0, 480, -240, 330, 60 * rng.randint(-23, 23)))
        sign, a = ("+" if off >= 0 else "-"), abs(off)
        tz = rng.choice((f"{sign}{a // 60:02d}{a % 60:02d}", f"{sign}{a // 60:02d}:{a % 60:02d}",
                         "Z" if off == 0 else f"{sign}{a // 60:02d}{a % 60:02d}"))
        sep = rng.choice((".", ","))
        line = f"{y:04d}-{mo:02d}-{d:02d}T{h:02d}:{mi:02d}:{s:02d}{sep}{us:06d}{tz} host kernel: {msg}"
        want = None if real is None or y < 1971 or y > 9998 else (real - timedelta(minutes=off)).timestamp()
        return line, want
    if shape == 1:   # syslog / short / short-precise (host zone, no year)
        frac = f".{us:06d}" if rng.random() < 0.5 else ""
        return f"{pick(rng, MONTHS)} {d:2d} {h:02d}:{mi:02d}:{s:02d}{frac} host kernel: [{rng.uniform(0, 1e7):12.6f}] {msg}", None
    if shape == 2:   # dmesg -T
        return f"[{pick(rng, DAYS)} {pick(rng, MONTHS)} {d:2d} {h:02d}:{mi:02d}:{s:02d} {y}] {msg}", None
    if shape == 3:   # dmesg raw / short-monotonic
        return f"[{rng.uniform(0, 1e9):12.6f}] {msg}", None
    if shape == 4:   # /dev/kmsg
        return f"{rng.randint(0, 191)},{rng.randint(0, 10**12)},{rng.randint(0, 10**19)},-;{msg}", None
    usec = rng.choice((rng.randint(0, 2 * 10**17), 10**20 - 1, 0))
    if shape == 5:   # journal export entry
        return f"__CURSOR=s=1;i=2\n__REALTIME_TIMESTAMP={usec}\n__MONOTONIC_TIMESTAMP=5\nMESSAGE={msg}\n", usec / 1e6
    if shape == 6:   # journal json
        body = msg.replace("\\", "\\\\").replace('"', '\\"')
        return f'{{"__REALTIME_TIMESTAMP":"{usec}","MESSAGE":"{body}","_HOSTNAME":"h"}}', usec / 1e6
    if shape == 7:   # short-unix
        return f"{rng.randint(10**8, 10**11)}.{us:06d} host kernel: {msg}", None
    zone = rng.choice(("UTC", "GMT", "CET", "JST", "Europe/Berlin", "X" * 40))   # short-full
    return f"{pick(rng, DAYS)} {y:04d}-{mo:02d}-{d:02d} {h:02d}:{mi:02d}:{s:02d} {zone} host kernel: {msg}", None


def _make(rng: random.Random) -> tuple[str, str, float | None, bool]:
    """(text, format, exact time of its only fault or None, whether to follow it from a file)."""
    lines, want = [], None
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        line, want = _stamped(rng, pick(rng, MESSAGES))
        if rng.random() < 0.5:
            line, want = mutate_text(rng, line, FRAGMENTS), None
        lines.append(line)
    if rng.random() < 0.1:   # a hostile line: the scans must stay linear
        lines.append("".join(pick(rng, BAIT) for _ in range(rng.randint(1, 5))) * rng.choice((10, 1000, 20000)))
    text = "\n".join(lines)[: mutate.TEXT_MAX * 2] + rng.choice(("\n", "", "\r\n"))
    exact = want if len(lines) == 1 and text.rstrip("\r\n") == lines[0].rstrip("\n") else None
    exact = exact if exact is None or exact < EPOCH_MAX else None
    return text, pick(rng, ["kernel", "kernel", "auto"]), exact, rng.random() < 0.25


def _check(records: list, exact: float | None) -> None:
    for rec in records:
        for metric, value, attrs in rec.values:
            if metric != "hw_fault":
                continue
            a = dict(attrs)
            ok = (value == 1.0 and a.get("vendor") in ("nvidia", "ascend") and a.get("class") in CLASSES
                  and isinstance(a.get("device"), str) and isinstance(a.get("meaning"), str)
                  and len(a.get("message", "")) <= 240 and a.get("time_basis") in BASES
                  and (isinstance(a.get("code"), int) if a["vendor"] == "nvidia"
                       else isinstance(a.get("code"), str) and len(a["code"]) == 10))
            if not ok:
                raise AssertionError(f"bad fault {a!r}")
            t, up = rec.log_time, a.get("uptime")
            if (t is None) != (a["time_basis"] in ("uptime", "none")):
                raise AssertionError(f"time {t!r} does not match its basis {a['time_basis']!r}")
            if t is not None and not (isinstance(t, float) and math.isfinite(t) and 0 <= t < EPOCH_MAX):
                raise AssertionError(f"time out of range {t!r}")
            if up is not None and not (isinstance(up, float) and math.isfinite(up) and up >= 0):
                raise AssertionError(f"bad uptime {up!r}")
            if exact is not None and t is not None and abs(t - exact) > 1e-3:
                raise AssertionError(f"read {t!r} for a stamp of {exact!r}")


def _run(payload: tuple[str, str, float | None, bool], work: Path) -> None:
    text, fmt, exact, follow = payload
    if not follow:
        parser = CompositeParser(fmt)
        records = parser.parse(Block(text, 1))
        if parser.errors:
            raise AssertionError(f"a parser raised: {parser.errors[0]}")
        _check(records, exact)
        return
    path = work / "kern.log"
    raw = text.encode("utf-8", "surrogatepass")
    path.write_bytes(mutate_bytes(random.Random(len(raw)), raw) if len(raw) % 3 == 0 else raw)
    stream = LogStream(str(path), {"host": "h"}, fmt, max_line_bytes=1 << 16)
    try:
        samples = stream.poll(1 << 22) + stream.finish()
    finally:
        stream.close()
    for s in samples:
        if s.metric == "hw_fault" and not (s.log_time is None or (math.isfinite(s.log_time) and 0 <= s.log_time < EPOCH_MAX)):
            raise AssertionError(f"time out of range {s.log_time!r}")


TARGETS = [Target("kernel_log", _make, _run)]
