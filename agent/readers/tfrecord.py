"""TFRecord framing, as TensorBoard event files use it: each record is ``uint64 length`` (little
endian), ``uint32 masked CRC-32C of those 8 bytes``, ``length`` bytes of data, ``uint32 masked
CRC-32C of the data``. Pure Python (no tensorflow, no crc32c package): the CRC is table-driven,
fast enough for scalar events (about 100 bytes each)."""

from __future__ import annotations

import struct

HEADER = 12
FOOTER = 4
MAX_SANE = 1 << 30  # a length beyond this is damage (or hostility), not a record being written


def _table() -> list[int]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        out.append(c)
    return out


_TABLE = _table()


def crc32c(data: bytes | memoryview) -> int:
    crc = 0xFFFFFFFF
    t = _TABLE
    for b in bytes(data):
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
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
    header's CRC does not hold or the length is not sane (the framing is lost there)."""
    length, crc = struct.unpack_from("<QI", buf, at)
    if length > MAX_SANE or masked_crc(bytes(buf[at:at + 8])) != crc:
        return None
    return length


def data_ok(buf: bytes | memoryview, at: int, length: int) -> bool:
    """Whether the data of a record (starting at ``at``, its CRC after it) is intact."""
    (crc,) = struct.unpack_from("<I", buf, at + length)
    return masked_crc(buf[at:at + length]) == crc


def resync(buf: bytes, start: int) -> int | None:
    """The first offset at or after ``start`` where a well-formed header lies, None when ``buf``
    holds none (a real length is below 4 GiB, so its high 4 bytes are zero: only those places are
    checked)."""
    at = start
    while True:
        z = buf.find(b"\0\0\0\0", at + 4)
        if z < 0 or z - 4 + HEADER > len(buf):
            return None
        cand = z - 4
        if cand >= start and header(buf, cand) is not None:
            return cand
        at = cand + 1
