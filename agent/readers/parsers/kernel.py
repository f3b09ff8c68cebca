"""Hardware faults in the host's kernel log: NVIDIA driver Xid lines.

Read from every shape the kernel log comes in, the message being the same in each:

* ``/var/log/kern.log`` / syslog: ``Jan 18 11:38:05 host kernel: [ 269.517039] NVRM: Xid ...`` or,
  with rsyslog's ISO stamps, ``2024-05-18T19:02:39.123456+00:00 host kernel: NVRM: Xid ...``;
* ``journalctl -k -o short-iso``: ``2024-05-18T19:02:39+0000 host kernel: NVRM: Xid ...`` (and the
  ``MESSAGE=NVRM: Xid ...`` field of ``-o export``);
* ``dmesg``: ``[ 1234.567890] NVRM: Xid ...``; ``/dev/kmsg``: ``<4>1234,5678,1234567890,-;NVRM: Xid ...``.

The messages (NVIDIA's Xid catalogue, docs.nvidia.com/deploy/xid-errors):
``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.``, older drivers without
``PCI:`` (``NVRM: Xid (0000:01:00): 3, C 00000005 ...``), newer ones with ``pid=..., name=...``
before the text (``94, pid=..., name=python, Contained: CE User Channel ...``).

Each Xid is one ``hw_fault`` sample (value 1, no step) with attrs ``vendor`` ("nvidia"), ``device``
(the PCI address), ``code``, ``class`` (hardware | application | unknown) and ``meaning`` from the
fault-code catalogue (agent/readers/fault_codes.yml, extendable: agent/readers/faultcodes.py), ``pid``
and ``process`` when printed, and ``message``: the driver's own text. Auto-detection sees only this
unmistakable shape (``NVRM: Xid (`` then an address); ``format: kernel`` on a watch reads nothing else.
"""

from __future__ import annotations

import re

from ...model import HW_FAULT
from ..faultcodes import current_codes
from .base import Block, Parser, Record

MESSAGE_CHARS = 240  # the driver's text kept on the sample, at most
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<dev>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)\): "
    r"(?P<code>\d{1,5})\b,? ?(?P<msg>[^\n]{0,%d})" % MESSAGE_CHARS)
_PID_RE = re.compile(r"\bpid=(?P<pid>\d{1,10}|'<unknown>'|<unknown>)(?:, name=(?P<name>[^,\n]{0,64}))?,? ?")


class KernelParser(Parser):
    name = "kernel"
    priority = 20
    copies = False  # the kernel prints each fault once; no rank copies to fold
    sparse = True   # a kernel log is mostly other lines: never "unrecognized" for want of faults
    keywords = ("NVRM: Xid",)

    def parse(self, block: Block) -> list[Record]:
        codes, _ = current_codes()
        out: list[Record] = []
        for m in _XID_RE.finditer(block.text):
            code = int(m.group("code"))
            msg = m.group("msg").strip()
            attrs: dict[str, object] = {"vendor": "nvidia", "device": m.group("dev").lower(), "code": code}
            p = _PID_RE.match(msg)
            if p:
                if p.group("pid").isdigit():
                    attrs["pid"] = int(p.group("pid"))
                if p.group("name") and p.group("name").strip() != "<unknown>":
                    attrs["process"] = p.group("name").strip()
                msg = msg[p.end():].strip()
            entry = codes.get(("nvidia_xid", code))
            attrs["class"] = entry.cls if entry else "unknown"
            attrs["meaning"] = entry.meaning if entry else f"Xid {code} (not in the fault-code catalogue)"
            attrs["message"] = msg
            rec = block.record(m.start(), None, self.name)
            rec.rank = None  # a kernel line has no trainer rank, whatever precedes it
            rec.values.append((HW_FAULT, 1.0, tuple(attrs.items())))
            out.append(rec)
        return out
