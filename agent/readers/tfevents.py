"""TensorBoard event files (``events.out.tfevents.*``): TFRecord-framed ``Event`` protos, read with
the project's bounded wire decoder (``protowire``), not tensorboard's loader (it brings protobuf and
reads whole files; the agent must follow a file being written and survive hostile bytes at a
bounded cost: docs/metric-files.md).

Scalars come from ``summary.value[]`` as ``simple_value`` (``add_scalar``, TF1, tensorboardX) or
as a one-element float/double/half/bfloat16 ``tensor`` (``add_scalar(new_style=True)``, TF2),
from ``tensor_content`` or ``float_val``/``double_val``/``half_val``. Only tags the metric map
names are decoded past their tag. ``Event.step`` is the step, ``wall_time`` the log time.

Traps handled here: a file being written ends in a partial record (the offset stays at its
start until the rest arrives); a record with a bad data CRC, or one that does not decode, is
counted and skipped; a header whose CRC does not hold loses the framing, which is found again
(``tfrecord.resync``) at the next well-formed header; a record longer than the limit is skipped
without being read into memory.
"""

from __future__ import annotations

import math
import struct
import time as _time
from typing import Any

from ..health import beat
from ..model import Sample
from ..protowire import WireError, as_view, decode_wire, read_varint
from . import tfrecord
from .filecursor import UNMAPPED_KEPT, MetricFileStream
from .metricmap import MetricMap, current_map

CHUNK = 1 << 20
RESYNC_SECONDS = 0.2  # per poll, searching for lost framing (a worker beats its heartbeat meanwhile)
_FLOAT_TYPES = {1: ("<f", 4), 2: ("<d", 8), 19: ("<e", 2), 14: ("bf16", 2)}  # DT_FLOAT, DOUBLE, HALF, BFLOAT16
_I64 = 1 << 63
# values per message level: an Event has ~4 fields, a Summary.Value ~4, a scalar TensorProto ~4,
# a merged Summary up to a few hundred values; beyond these the message is hostile, not big
EVENT_FIELDS, SUMMARY_VALUES, VALUE_FIELDS = 64, 16384, 64


def _one(fields: dict[int, list[tuple[int, Any]]], number: int, wire: int) -> Any:
    vals = fields.get(number)
    if not vals:
        return None
    w, v = vals[-1]  # proto semantics: the last one wins
    return v if w == wire else None


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _tensor_scalar(data: memoryview) -> float | None:
    """The value of a one-element floating-point TensorProto, None for anything else."""
    t = decode_wire(data, 1, VALUE_FIELDS)
    dtype = _one(t, 1, 0)
    if dtype not in _FLOAT_TYPES:
        return None
    shape = _one(t, 2, 2)
    if shape is not None:
        n = 1
        for wire, dim in decode_wire(shape, 2, VALUE_FIELDS).get(2, ()):
            if wire == 2:
                size = _one(decode_wire(dim, 3, VALUE_FIELDS), 1, 0)
                n *= 0 if size is None else size
        if n != 1:
            return None
    fmt, width = _FLOAT_TYPES[dtype]
    content = _one(t, 4, 2)
    if content is not None and len(content):
        if len(content) != width:
            return None
        if fmt == "bf16":
            return _bf16(int.from_bytes(content, "little"))
        return struct.unpack(fmt, content)[0]
    if dtype == 1:
        return _packed_fixed(t.get(5), 5, "<f")
    if dtype == 2:
        return _packed_fixed(t.get(6), 1, "<d")
    for wire, v in t.get(13, ()):  # half_val: the 16 bits of a half or a bfloat16, as varints
        if wire == 2 and len(v):
            bits, _ = read_varint(v, 0, len(v))
        elif wire == 0:
            bits = v
        else:
            continue
        return _bf16(bits) if fmt == "bf16" else struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]
    return None


def _packed_fixed(vals: list[tuple[int, Any]] | None, wire_one: int, fmt: str) -> float | None:
    width = struct.calcsize(fmt)
    for wire, v in vals or ():
        if wire == 2 and len(v) == width:
            return struct.unpack(fmt, v)[0]
        if wire == wire_one:
            return struct.unpack(fmt, v.to_bytes(width, "little"))[0]
    return None


def decode_event(data: bytes | memoryview, mmap: MetricMap, unmapped: dict[str, None] | None = None
                 ) -> tuple[float | None, int | None, list[tuple[str, float]]]:
    """``(wall_time, step, [(metric, value)])`` of one Event; raises WireError for damaged bytes.
    Tags the map does not name go to ``unmapped`` (at most UNMAPPED_KEPT of them)."""
    ev = decode_wire(data, 0, EVENT_FIELDS)
    wt = _one(ev, 1, 1)
    wall = struct.unpack("<d", wt.to_bytes(8, "little"))[0] if wt is not None else None
    if wall is not None and not math.isfinite(wall):
        wall = None
    step = _one(ev, 2, 0)
    if step is not None and step >= _I64:
        step -= 1 << 64
    out: list[tuple[str, float]] = []
    summary = _one(ev, 5, 2)
    if summary is None:
        return wall, step, out
    for wire, value in decode_wire(summary, 1, SUMMARY_VALUES).get(1, ()):
        if wire != 2:
            continue
        v = decode_wire(value, 2, VALUE_FIELDS)
        tag = _one(v, 1, 2)
        if tag is None or len(tag) > 256:
            continue
        try:
            metric = mmap.metric(bytes(tag).decode("utf-8"))
        except UnicodeDecodeError:
            continue
        if metric is None:
            if unmapped is not None and len(unmapped) < UNMAPPED_KEPT:
                unmapped[bytes(tag).decode("utf-8")] = None
            continue
        simple = _one(v, 2, 5)
        if simple is not None:
            out.append((metric, struct.unpack("<f", simple.to_bytes(4, "little"))[0]))
        elif (tensor := _one(v, 8, 2)) is not None and (x := _tensor_scalar(tensor)) is not None:
            out.append((metric, x))
    return wall, step, out


def is_event_file(head: bytes) -> bool:
    """Content sniffing: ``head`` (the file's first bytes) starts with a well-formed record."""
    return len(head) >= tfrecord.HEADER and tfrecord.header(head, 0) is not None


class TfEventsStream(MetricFileStream):
    FORMAT = "tfevents"
    NAMES = "tags"
    _lost = False  # searching for the next well-formed header (said and counted once per search)

    def _read(self, budget: int, now: float | None, final: bool) -> list[Sample]:
        cur = self.tailer
        size = cur.size()
        held = self.existing(size)
        if size is None:
            return []
        if held is not None:
            self._skip_existing(held)
        mmap, _ = current_map()
        t = _time.time() if now is None else now
        out: list[Sample] = []
        start = cur.offset
        deadline = _time.monotonic() + RESYNC_SECONDS  # (searching for lost framing only)
        timed_out = False
        while budget > 0 and cur.offset < size:
            if self._lost:  # a damaged or zero-filled stretch: bounded work per poll, and progress
                beat()
                if timed_out := _time.monotonic() > deadline:
                    break  # the next poll goes on from here (the offset is where the search is)
            pos = cur.offset
            buf = cur.pread(min(max(budget, tfrecord.HEADER), CHUNK, size - pos), pos)
            if len(buf) < tfrecord.HEADER:
                break
            used = self._records(buf, pos, size, mmap, t, out, deadline)
            if used == 0:
                break  # a partial record: wait for its rest
            budget -= used
        if final and cur.offset < size:
            self.skipped("torn", f"ends in a torn record at byte {cur.offset} ({size - cur.offset} bytes)")
            cur.offset = size
        cur.seen = size if budget > 0 and not timed_out else cur.offset  # (the rest is backlog)
        self.stats.bytes += cur.offset - start
        if cur.offset == size and cur.replaced():
            return out + self._read(budget, now, final)
        return out

    def _skip_existing(self, size: int) -> None:
        """``start_at_end``: go on after the last whole record already in the file (its headers
        are walked, the data is not read; a damaged header stops the walk there)."""
        cur = self.tailer
        at, n = cur.offset, 0
        self.at_end = False
        while size - at >= tfrecord.HEADER:
            buf = cur.pread(min(CHUNK, size - at), at)
            pos = 0
            while len(buf) - pos >= tfrecord.HEADER:
                length = tfrecord.header(buf, pos)
                if length is None or at + pos + tfrecord.HEADER + length + tfrecord.FOOTER > size:
                    cur.offset, cur.line = at + pos, cur.line + n
                    return
                pos += tfrecord.HEADER + length + tfrecord.FOOTER
                n += 1
            if pos == 0 and len(buf) < tfrecord.HEADER:
                break  # (an I/O error, said by the cursor)
            at += pos
        cur.offset, cur.line = at, cur.line + n

    def _records(self, buf: bytes, base: int, size: int, mmap: MetricMap, t: float, out: list[Sample],
                 deadline: float | None = None) -> int:
        """Read the whole records in ``buf`` (the file's bytes from ``base``); the bytes used
        (while searching for lost framing: the bytes searched, up to ``deadline``)."""
        cur, at, end = self.tailer, 0, len(buf)
        view = as_view(buf)
        while end - at >= tfrecord.HEADER:
            length = tfrecord.header(buf, at)
            if length is None:  # the framing is lost here: find the next well-formed header
                if not self._lost:
                    self._lost = True
                    self.skipped("framing", f"damaged record header at byte {base + at}; skipping to the "
                                 "next well-formed record")
                nxt, resume = tfrecord.resync(buf, at + 1, deadline)
                # (before ``resume`` no header starts: the offset goes there, and a header being
                # written at the end of the file is looked for again when it is whole)
                at = resume
                cur.offset = base + at
                if nxt is None:
                    break
                continue
            self._lost = False
            total = tfrecord.HEADER + length + tfrecord.FOOTER
            if base + at + total > size:
                break  # partial record: its rest is still being written
            if length > self.max_record:
                self.skipped("oversized", f"record of {length} bytes at byte {base + at} is over the "
                             f"limit ({self.max_record}); skipped without reading it")
            elif at + total <= end:
                self._record(view, at, length, base + at, mmap, t, out)
            elif at == 0:  # longer than a chunk but within the limit: read it whole
                whole = cur.pread(total, base)
                if len(whole) < total:
                    break  # (an I/O error, said by the cursor: try again at the next poll)
                self._record(as_view(whole), 0, length, base, mmap, t, out)
            else:
                break  # the next chunk starts with it
            at += total
            cur.line += 1
            cur.offset = base + at
        return at

    def _record(self, view: memoryview, at: int, length: int, offset: int, mmap: MetricMap, t: float,
                out: list[Sample]) -> None:
        data = view[at + tfrecord.HEADER:at + tfrecord.HEADER + length]
        self.stats.lines += 1
        try:
            wall, step, values = decode_event(data, mmap, self.unmapped)
        except (WireError, struct.error, OverflowError) as exc:
            # which of the two: worth a CRC only for a record of a scalar's size
            if length <= 1 << 16 and not tfrecord.data_ok(view, at + tfrecord.HEADER, length):
                self.skipped("crc", f"record at byte {offset} fails its CRC; skipped")
            else:
                self.skipped("decode", f"record at byte {offset} is not an Event ({exc}); skipped")
            return
        if not values:
            return
        # the CRC is checked where it matters, on records that carry our scalars (a scalar event
        # is ~100 bytes; images and histograms, which can be megabytes, are not worth the cost)
        if not tfrecord.data_ok(view, at + tfrecord.HEADER, length):
            self.skipped("crc", f"record at byte {offset} fails its CRC; skipped")
            return
        self.stats.records += 1
        line = self.tailer.line + 1
        for metric, value in values:
            out.append(self.sample(metric, value, step, line, offset, t, wall))
