"""The common case of a dump zip, read with a few ``pread`` calls on one descriptor.

``torch.save`` writes a small zip whose members are all stored (uncompressed): ``data.pkl``,
a few one-line members and ``data/<key>``, the tensor bytes. :mod:`zipfile` parses it with
a dozen Python-level reads and objects per member, and the tensor was then mapped through a
second ``open``: about 0.3 ms per file, most of a comparison of many small tensors.

:func:`read_stored_zip` reads the file's head and tail (one ``pread`` each, more only for a
member outside both) and parses the end records and the central directory itself, accepting
only the plain layout: no archive comment, no bytes before the archive, no multi-disk or
encrypted or compressed member, no zip64 or malformed extra field, no overlapping members, one
zip64 end record at most (torch always writes one). Anything else gives None and the caller
takes :mod:`zipfile`'s path, which reports the problem as before; what this module accepts,
zipfile accepts with the same members, offsets and bytes (tests/dumps/test_storedzip.py checks
that on mutated files). Member reads check the local header's signature and name and the
CRC-32, as zipfile's do.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import NamedTuple

HEAD = TAIL = 4096
_EOCD = struct.Struct("<4s4H2LH")               # end of central directory, 22 bytes
_LOC64 = struct.Struct("<4sLQL")                # zip64 end locator, 20 bytes
_END64 = struct.Struct("<4sQ2H2L4Q")            # zip64 end record, 56 bytes
_CDIR = struct.Struct("<4s4B4HL2L5H2L")         # central directory entry, 46 bytes
_LOCAL = struct.Struct("<4s2B4HL2L2H")          # local file header, 30 bytes
_FLAGS_OK = 0x808                               # data descriptor, UTF-8 names


class Member(NamedTuple):
    """One stored member, with the two fields the readers use under zipfile.ZipInfo's names."""

    name: str
    header_offset: int
    size: int
    crc: int
    flags: int
    extract_version: int
    extra: bytes

    @property
    def filename(self) -> str:
        return self.name

    @property
    def file_size(self) -> int:
        return self.size


class StoredZip:
    """A zip's members (``members``, by name: the last of a repeated name, as zipfile's
    ``{i.filename: i for i in infolist()}``) and its bytes through one descriptor."""

    __slots__ = ("fd", "size", "head", "tail", "tail_off", "members", "_ends")

    def __init__(self, fd: int, size: int, head: bytes, tail: bytes) -> None:
        self.fd, self.size = fd, size
        self.head, self.tail, self.tail_off = head, tail, size - len(tail)
        self.members: dict[str, Member] = {}
        self._ends: dict[int, int] = {}          # header offset -> where the next member starts

    def read(self, off: int, n: int) -> bytes:
        """``n`` bytes at ``off`` (fewer at the end of the file)."""
        if off + n <= len(self.head):
            return self.head[off:off + n]
        if off >= self.tail_off:
            return self.tail[off - self.tail_off:off - self.tail_off + n]
        return os.pread(self.fd, n, off)

    def data_offset(self, m: Member) -> int | None:
        """Where a member's bytes start (after its local header), None when the header is not
        a plain one or the member runs past the next one or the end of the file."""
        raw = self.read(m.header_offset, _LOCAL.size)
        if len(raw) != _LOCAL.size:
            return None
        h = _LOCAL.unpack(raw)
        if h[0] != b"PK\x03\x04":
            return None
        off = m.header_offset + _LOCAL.size + h[10] + h[11]
        if off + m.size > self._ends[m.header_offset]:
            return None
        return off if _name(self.read(m.header_offset + _LOCAL.size, h[10]), h[3]) == m.name else None

    def member(self, m: Member) -> bytes | None:
        """A member's bytes, None when its header or CRC-32 is not right."""
        off = self.data_offset(m)
        if off is None:
            return None
        data = self.read(off, m.size)
        if len(data) != m.size or zlib.crc32(data) != m.crc:
            return None
        return data


def _name(raw: bytes, flags: int) -> str | None:
    """A member name as zipfile decodes it (UTF-8 with flag bit 11, else cp437); None if it cannot."""
    if raw.isascii():
        return raw.decode("ascii")
    try:
        return raw.decode("utf-8") if flags & 0x800 else raw.decode("cp437")
    except UnicodeDecodeError:
        return None


def read_stored_zip(fd: int, *, max_members: int, max_uncompressed: int,
                    size: int | None = None) -> StoredZip | None:
    """The directory of the zip open at ``fd`` (``size``: its size, when the caller has it from
    its own ``fstat``), or None when it is not the plain layout (see the module docstring) or
    breaks a limit (zipfile's path then says which)."""
    if size is None:
        size = os.fstat(fd).st_size
    if size < _EOCD.size:
        return None
    head = os.pread(fd, min(HEAD, size), 0)
    tail = head if size <= HEAD else os.pread(fd, min(TAIL, size), max(0, size - TAIL))
    z = StoredZip(fd, size, head, tail)
    end = size - _EOCD.size
    e = _EOCD.unpack(z.read(end, _EOCD.size))
    if e[0] != b"PK\x05\x06" or e[7] != 0:
        return None
    disk, disk_dir, count, total, cd_size, cd_off = e[1:7]
    stop = end
    if end >= _LOC64.size + _END64.size:
        loc = _LOC64.unpack(z.read(end - _LOC64.size, _LOC64.size))
        if loc[0] == b"PK\x06\x07":
            if loc[1] != 0 or loc[3] > 1:
                return None
            stop = end - _LOC64.size - _END64.size
            r = _END64.unpack(z.read(stop, _END64.size))
            if r[0] != b"PK\x06\x06" or r[1] != _END64.size - 12:
                return None
            disk, disk_dir, count, total, cd_size, cd_off = r[4:10]
    if disk or disk_dir or count != total or total > max_members or cd_off + cd_size != stop:
        return None
    cd = z.read(cd_off, cd_size)
    if len(cd) != cd_size:
        return None
    pos, declared, spans = 0, 0, []
    for _ in range(total):
        if pos + _CDIR.size > cd_size:
            return None
        (sig, _cv, _cs, extract_version, _r, flags, method, _t, _d, crc, csize, usize, nlen, xlen, clen,
         *_rest, header_offset) = _CDIR.unpack_from(cd, pos)
        if (sig != b"PK\x01\x02" or extract_version > 45 or flags & ~_FLAGS_OK or method != 0
                or csize != usize or clen or nlen == 0):
            return None
        p = pos + _CDIR.size
        raw, extra = cd[p:p + nlen], cd[p + nlen:p + nlen + xlen]
        pos = p + nlen + xlen
        name = _name(raw, flags)
        if len(raw) != nlen or len(extra) != xlen or name is None or "\x00" in name or (xlen and not _plain_extra(extra)):
            return None
        z.members[name] = Member(name, header_offset, usize, crc, flags, extract_version, extra)
        spans.append((header_offset, header_offset + _LOCAL.size + nlen + usize))   # end with no local extra
        declared += usize
    if pos != cd_size or declared > max_uncompressed:
        return None
    spans.sort()
    for (a, low), nxt in zip(spans, [s[0] for s in spans[1:]] + [cd_off]):
        if low > nxt or a in z._ends:
            return None   # members overlap
        z._ends[a] = nxt
    return z


def _plain_extra(extra: bytes) -> bool:
    """Well-formed extra field records, none of them zip64's (which zipfile would decode)."""
    i = 0
    while i < len(extra):
        if i + 4 > len(extra):
            return False
        tag, n = struct.unpack_from("<HH", extra, i)
        if tag == 0x0001 or i + 4 + n > len(extra):
            return False
        i += 4 + n
    return True
