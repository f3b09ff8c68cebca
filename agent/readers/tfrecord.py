"""TFRecord framing, as TensorBoard event files use it: each record is ``uint64 length`` (little
endian), ``uint32 masked CRC-32C of those 8 bytes``, ``length`` bytes of data, ``uint32 masked
CRC-32C of the data``. Pure Python (no tensorflow, no crc32c package): the CRC is table-driven,
8 bytes per step: scalar events are about 100 bytes each."""

from __future__ import annotations

import re
import struct
import time

HEADER = 12
FOOTER = 4
MAX_SANE = 1 << 30  # a length beyond this is damage (or hostility), not a record being written


def _tables() -> list[list[int]]:
    """The CRC-32C (Castagnoli) table and its seven shifted copies (slicing by 8)."""
    base = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        base.append(c)
    out = [base]
    for _ in range(7):
        prev = out[-1]
        out.append([(prev[i] >> 8) ^ base[prev[i] & 0xFF] for i in range(256)])
    return out


_T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7 = _tables()
_Q = struct.Struct("<Q")


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C, 8 bytes per step (twice the speed of a byte loop in Python)."""
    data = bytes(data)
    crc = 0xFFFFFFFF
    n = len(data) - len(data) % 8
    t0, t1, t2, t3, t4, t5, t6, t7 = _T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7
    for (q,) in _Q.iter_unpack(data[:n]):
        x = crc ^ (q & 0xFFFFFFFF)
        hi = q >> 32
        crc = (t7[x & 0xFF] ^ t6[(x >> 8) & 0xFF] ^ t5[(x >> 16) & 0xFF] ^ t4[x >> 24]
               ^ t3[hi & 0xFF] ^ t2[(hi >> 8) & 0xFF] ^ t1[(hi >> 16) & 0xFF] ^ t0[hi >> 24])
    for b in data[n:]:
        crc = t0[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes | memoryview) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One record around ``data`` (for tests and tools: the agent only reads)."""
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc(head)) + data + struct.pack("<I", masked_crc(data))


def header(buf: bytes | memoryview, at: int) -> int | None:
    """The data length of the record whose header starts at ``at`` of ``buf``; None when the
    header's CRC does not hold or the length is not sane (the framing is lost there). Twelve zero
    bytes (a zero-filled stretch: a crash's unwritten tail, a preallocated file) are refused before
    the CRC: no writer frames an empty Event."""
    length, crc = struct.unpack_from("<QI", buf, at)
    if length > MAX_SANE or (length == 0 and crc == 0) or masked_crc(bytes(buf[at:at + 8])) != crc:
        return None
    return length


def data_ok(buf: bytes | memoryview, at: int, length: int) -> bool:
    """Whether the data of a record (starting at ``at``, its CRC after it) is intact."""
    (crc,) = struct.unpack_from("<I", buf, at + length)
    return masked_crc(buf[at:at + length]) == crc


_NONZERO = re.compile(rb"[^\0]")


def resync(buf: bytes, start: int, deadline: float | None = None) -> tuple[int | None, int]:
    """``(found, resume)``: the first offset at or after ``start`` where a well-formed header lies
    (``found``, None when ``buf`` holds none), and where a later search goes on (``found``, the
    first place a header was not checked because it does not fit in ``buf``, or where the search
    stopped at ``deadline``, a ``time.monotonic()``). A real length is below 4 GiB, so its high 4
    bytes are zero: only those places are candidates, and a zero-filled stretch is passed over at
    once (its candidates are twelve zero bytes, refused without a CRC)."""
    at = start
    checked = 0
    while True:
        z = buf.find(b"\0\0\0\0", at + 4)
        if z < 0 or z - 4 + HEADER > len(buf):
            return None, max(start, len(buf) - HEADER + 1)
        cand = z - 4
        if cand >= start:
            if not any(buf[cand:cand + HEADER]):  # zero fill: go to its end
                m = _NONZERO.search(buf, cand)
                at = max(cand + 1, (m.start() if m else len(buf)) - HEADER + 1)
                continue
            if header(buf, cand) is not None:
                return cand, cand
            checked += 1
            if deadline is not None and checked % 256 == 0 and time.monotonic() > deadline:
                return None, cand + 1
        at = cand + 1
