"""Hardware faults in the host's kernel log: NVIDIA driver Xid lines and the Ascend NPU driver's
device fault messages.

Read from every shape the kernel log comes in (the stamps and how they become ``log_time``:
kernel_time.py): ``/var/log/kern.log`` / syslog (``Nov 28 07:42:14 host kernel: [12345.678901] msg``,
rsyslog's RFC 3339 ``2024-05-18T19:02:39.123456+00:00 host kernel: msg``, EulerOS's
``2020-12-31T00:39:25.857705+08:00|warning|kernel[-]|[21202265.886150] msg``), ``journalctl -k``
(default, ``-o short-precise``, ``short-iso[-precise]``, ``short-full``, ``short-unix``,
``short-monotonic``, the ``MESSAGE=`` lines of ``-o export`` and ``-o json`` lines), ``dmesg``
(raw ``[12345.678901] msg``, ``-T`` ``[Fri Aug 30 11:43:09 2024] msg``, ``--time-format iso``) and
``/dev/kmsg`` records saved to a file (``4,1894,8721061820,-;msg``).

The messages:

* NVIDIA (Xid catalogue, docs.nvidia.com/deploy/xid-errors): ``NVRM: Xid (PCI:0000:3b:00): 79,
  pid=1234, GPU has fallen off the bus.``, older drivers without ``PCI:`` (``NVRM: Xid (0000:01:00):
  3, ...``), newer ones with ``pid=..., name=...`` before the text, a MIG GPU's with its instances
  (``NVRM: Xid (PCI:0000:3b:00 GPU-I:02 GPU-CI:01): 94, ...``). ``vendor`` "nvidia", ``device``
  the PCI address, ``code`` the Xid (a number), ``gpu_instance``/``compute_instance`` on MIG.
* Ascend (the open driver, github.com/hicann/driver): the fault manager's record of a device fault
  event, ``[ascend] [fault_manager] [ERROR] [dms_record_fault_event_log 1410] event_id=0x80e01801;
  device_id=0; node_type=0x70[HBM]; ...; severity=2[Alarm]; assertion=1[Event occur]; ...``
  (src/sdk_driver/fms/smf/event/dms_event.c), and the host's lost heartbeat of a device,
  ``[ascend] [ERROR] [drv_soft_fault] [heart_beat_judge 318] <kworker/5:1H:39365> Heartbeat lost!
  (device=1; ...)`` (fault 0x40F84E00 in MindCluster's fault knowledge base). ``vendor`` "ascend",
  ``device`` the device id as printed ("0"), ``code`` the fault event id as text ("0x80E01801").
  An event whose assertion is 0 (``Event resume``: the fault cleared) is no fault.

Each fault is one ``hw_fault`` sample (value 1, no step) with attrs ``vendor``, ``device``, ``code``,
``class`` (hardware | application | unknown) and ``meaning`` from the fault-code catalogue
(agent/readers/fault_codes.yml, extendable: agent/readers/faultcodes.py), ``message`` (the
driver's own text, at most 240 characters), ``time_basis`` (how ``log_time`` was read:
kernel_time.BASES) and, when printed, ``uptime`` (seconds since boot), ``pid``/``process`` (Xid),
``severity`` (Ascend). A GPU that fell off the bus without an Xid 79 line near it (older drivers,
the probe-time three-line message) is the same fault: code 79 with attr ``inferred``. Auto-detection sees only these unmistakable shapes; ``format: kernel`` on
a watch reads nothing else.
"""

from __future__ import annotations

import re

from ...model import HW_FAULT
from ..faultcodes import FaultCode, current_codes, hex_code
from .base import Block, Parser, Record
from .kernel_time import line_time

MESSAGE_CHARS = 240  # the driver's text kept on the sample, at most
# on a MIG GPU the driver attributes the Xid to its GPU instance, and compute instance where known
# (kernel_rc.c: "PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u"): the device stays the physical GPU
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<dev>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
    r"(?: GPU-I:(?P<gi>\d{1,3})(?: GPU-CI:(?P<ci>\d{1,3}))?)?\): "
    r"(?P<code>\d{1,5})\b,? ?(?P<msg>[^\n]{0,%d})" % MESSAGE_CHARS)
_ADDR = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
# "fallen off the bus" without an Xid line: older drivers (``GPU at 0000:01:00.0 has fallen off the
# bus.``, before an Xid of another code) and probe-time messages over three lines (NVIDIA/NVSentinel#155)
_OFF_BUS_RE = re.compile(
    r"NVRM: (?:GPU at (?:PCI:)?(?P<d1>%s) has fallen off the bus\.|GPU (?P<d2>%s): GPU has fallen off the bus\."
    r"|The NVIDIA GPU (?P<d3>%s)[ \t]{0,8}\n[^\n]{0,120}?NVRM: \(PCI ID: [^\n]{0,60}\n[^\n]{0,120}?NVRM: "
    r"fallen off the bus)" % (_ADDR, _ADDR, _ADDR))
OFF_BUS_NEAR = 10  # lines: an Xid 79 of the same GPU this close is the same event
_PID_RE = re.compile(r"\bpid=(?P<pid>\d{1,10}|'<unknown>'|<unknown>)(?:, name=(?P<name>[^,\n]{0,64}))?,? ?")
# Ascend: the fault manager's event record (either order of module and level) and a lost heartbeat
_ASCEND_EVENT_RE = re.compile(
    r"\[ascend\] (?:\[ERROR\] )?\[fault_manager\] [^\n]{0,120}?\bevent_id=0x(?P<code>[0-9a-fA-F]{1,8}); "
    r"device_id=(?P<dev>\d{1,6});(?P<msg>[^\n]{0,%d})" % (MESSAGE_CHARS + 160))
_ASCEND_HB_RE = re.compile(
    r"\[ascend\] (?:\[ERROR\] )?\[drv_soft_fault\] [^\n]{0,160}?(?P<msg>Heartbeat lost! \(device(?:_id)?="
    r"(?P<dev>\d{1,6});[^\n]{0,%d})" % MESSAGE_CHARS)
_ASSERTION_RE = re.compile(r"\bassertion=(?P<a>\d{1,3})")
_SEVERITY_RE = re.compile(r"\bseverity=\d{1,3}\[(?P<s>[A-Za-z ]{1,16})\]")
ASCEND_HEARTBEAT_LOST = 0x40F84E00  # MindCluster's code for "Heartbeat lost!" in the host's messages
_JSON_END = re.compile(r'(?<!\\)"')
# the program tag of a syslog-shaped line ("host kernel: ", "host python3[812]: ", EulerOS's
# "|kernel[-]|"): a fault must come from the kernel, not from a user's ``logger "NVRM: Xid ..."``
# the journal's own field naming who wrote an entry: "kernel" for the kernel's ring buffer, "syslog",
# "journal", "stdout" for programs (a user's `logger` too)
_TRANSPORT_JSON = re.compile(r'"_TRANSPORT"\s*:\s*"([^"\n]{0,32})"')
_TRANSPORT_EXPORT = re.compile(r"^_TRANSPORT=([^\n]{0,32})$", re.M)
ENTRY_CHARS = 16384   # how far an export entry's fields are looked for around its MESSAGE= line
_TAG_RE = re.compile(r"(?<![^\s|])([A-Za-z][\w.\-/]{0,63})(?:\[[^\]\n]{0,24}\])?(?=:\s|\|)")


class KernelParser(Parser):
    name = "kernel"
    priority = 20
    copies = False  # the kernel prints each fault once; no rank copies to fold
    sparse = True   # a kernel log is mostly other lines: never "unrecognized" for want of faults
    keywords = ("NVRM: Xid", "[ascend] [", "fallen off the bus")

    def parse(self, block: Block) -> list[Record]:
        codes, _ = current_codes()
        text = block.text
        out: list[Record] = []
        if "NVRM: Xid" in text:
            for m in _XID_RE.finditer(text):
                code = int(m.group("code"))
                attrs: dict[str, object] = {"vendor": "nvidia", "device": m.group("dev").lower(), "code": code}
                if m.group("gi") is not None:
                    attrs["gpu_instance"] = int(m.group("gi"))
                    if m.group("ci") is not None:
                        attrs["compute_instance"] = int(m.group("ci"))
                msg = _message(text, m.start(), m.group("msg"))
                p = _PID_RE.match(msg)
                if p:
                    if p.group("pid").isdigit():
                        attrs["pid"] = int(p.group("pid"))
                    if p.group("name") and p.group("name").strip() != "<unknown>":
                        attrs["process"] = p.group("name").strip()
                    msg = msg[p.end():].strip()
                _classify(attrs, codes.get(("nvidia_xid", code)), f"Xid {code}")
                out.append(_record(block, m.start(), attrs, msg))
        if "fallen off the bus" in text:
            out.extend(_off_bus(block, out, codes))
        if "[ascend] [" in text:
            for m in _ASCEND_EVENT_RE.finditer(text):
                rest = m.group("msg")
                a = _ASSERTION_RE.search(rest)
                if a and int(a.group("a")) == 0:
                    continue  # "Event resume": the fault cleared
                attrs = {"vendor": "ascend", "device": m.group("dev"), "code": hex_code(int(m.group("code"), 16))}
                s = _SEVERITY_RE.search(rest)
                if s:
                    attrs["severity"] = s.group("s").strip()
                msg = _message(text, m.start(), ("event_id=0x" + m.group("code") + "; device_id=" + m.group("dev")
                                                 + ";" + rest)[:MESSAGE_CHARS])
                _classify(attrs, codes.get(("ascend", attrs["code"])), f"fault {attrs['code']}")
                out.append(_record(block, m.start(), attrs, msg))
            for m in _ASCEND_HB_RE.finditer(text):
                attrs = {"vendor": "ascend", "device": m.group("dev"), "code": hex_code(ASCEND_HEARTBEAT_LOST)}
                _classify(attrs, codes.get(("ascend", attrs["code"])), f"fault {attrs['code']}")
                out.append(_record(block, m.start(), attrs, _message(text, m.start(), m.group("msg"))))
        if out:
            out = [r for r in out if _from_kernel(text, r.pos)]
        if len(out) > 1:
            out.sort(key=lambda r: r.pos)
        return out


def _from_kernel(text: str, pos: int) -> bool:
    """False when the line names a program other than the kernel before the message (syslog's tag):
    anyone may write "NVRM: Xid ..." to syslog; only the kernel's lines are faults. A line with no
    tag (dmesg, kmsg records) is the kernel's. The journal's export and JSON entries say who wrote
    them in ``_TRANSPORT``: only "kernel" is (an entry without the field is taken as the kernel's)."""
    start = text.rfind("\n", 0, pos) + 1
    if text.startswith("{", start):                               # journalctl -o json: one line
        end = text.find("\n", pos)
        m = _TRANSPORT_JSON.search(text, start, len(text) if end < 0 else end)
        return m is None or m.group(1) == "kernel"
    if text.startswith("MESSAGE=", start):                        # journalctl -o export
        lo = text.rfind("\n\n", max(0, start - ENTRY_CHARS), start)
        hi = text.find("\n\n", pos, pos + ENTRY_CHARS)
        m = _TRANSPORT_EXPORT.search(text, max(0, start - ENTRY_CHARS) if lo < 0 else lo,
                                     min(len(text), pos + ENTRY_CHARS) if hi < 0 else hi)
        return m is None or m.group(1) == "kernel"
    tags = _TAG_RE.findall(text, max(start, pos - 240), pos)
    return not tags or tags[-1] == "kernel"


def _off_bus(block: Block, xids: list[Record], codes: dict) -> list[Record]:
    """A GPU that fell off the bus without its Xid 79 line (none of the same GPU within
    ``OFF_BUS_NEAR`` lines): the same fault, code 79, attr ``inferred``."""
    seen = [(dict(r.values[0][2]).get("device"), r.line) for r in xids if dict(r.values[0][2]).get("code") == 79]
    out = []
    for m in _OFF_BUS_RE.finditer(block.text):
        dev = re.sub(r"\.[0-7]$", "", m.group("d1") or m.group("d2") or m.group("d3")).lower()
        line = block.line_of(m.start())
        if any(d == dev and abs(n - line) <= OFF_BUS_NEAR for d, n in seen):
            continue
        attrs: dict[str, object] = {"vendor": "nvidia", "device": dev, "code": 79, "inferred": True}
        _classify(attrs, codes.get(("nvidia_xid", 79)), "Xid 79")
        out.append(_record(block, m.start(), attrs, " ".join(m.group().split())[:MESSAGE_CHARS]))
        seen.append((dev, line))
    return out


def _classify(attrs: dict[str, object], entry: FaultCode | None, name: str) -> None:
    attrs["class"] = entry.cls if entry else "unknown"
    attrs["meaning"] = entry.meaning if entry else f"{name} (not in the fault-code catalogue)"


def _message(text: str, pos: int, msg: str) -> str:
    """The driver's text, cut where a ``journalctl -o json`` line's MESSAGE string ends."""
    if text.startswith("{", text.rfind("\n", 0, pos) + 1):
        end = _JSON_END.search(msg)
        if end:
            msg = msg[:end.start()]
    return msg.strip()[:MESSAGE_CHARS]


def _record(block: Block, pos: int, attrs: dict[str, object], msg: str) -> Record:
    text = block.text
    start = text.rfind("\n", 0, pos) + 1
    log_time, uptime, basis = line_time(text, start, pos)
    attrs["message"] = msg
    attrs["time_basis"] = basis
    if uptime is not None:
        attrs["uptime"] = uptime
    rec = block.record(pos, None, KernelParser.name)
    rec.log_time = log_time
    rec.rank = None  # a kernel line has no trainer rank, whatever precedes it
    rec.values.append((HW_FAULT, 1.0, tuple(attrs.items())))
    return rec
