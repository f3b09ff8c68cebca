"""The protobuf wire format, decoded defensively: shared by the dump readers (CANN ``DumpData``)
and the metric-file readers (TensorBoard ``Event``), hence a base module.

No generated code and no protobuf dependency. Every read is bounds-checked, nesting depth is
capped, and nothing larger than the input is ever allocated (length-delimited values are
``memoryview`` slices of the input, declared lengths are checked before any use, and the number
of values decoded per message is capped). Hostile input raises :class:`WireError`, nothing else.

Wire types handled: 0 varint, 1 64-bit, 2 length-delimited, 5 32-bit. Groups (3, 4) and unknown
wire types are rejected.
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 32
MAX_FIELDS = 1 << 20      # values per message level (each costs a Python object)
_MAX_FIELD = (1 << 29) - 1
_U64 = (1 << 64) - 1


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message (truncated, hostile): the message says why."""


def read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """Decode one varint at ``pos``; return (value, next position)."""
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError(f"protobuf: truncated varint at byte {pos}")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
        if shift >= 70:
            raise WireError(f"protobuf: varint longer than 10 bytes at byte {pos}")
    if result > _U64:
        raise WireError("protobuf: varint does not fit in 64 bits")
    return result, pos


def as_view(data: bytes | memoryview) -> memoryview:
    """A flat byte view of ``data`` (a copy only for an odd-shaped view)."""
    buf = data if isinstance(data, memoryview) else memoryview(data)
    if buf.format != "B" or buf.ndim != 1 or not buf.c_contiguous:
        buf = memoryview(buf.tobytes())
    return buf


def decode_wire(data: bytes | memoryview, depth: int = 0,
                max_fields: int = MAX_FIELDS) -> dict[int, list[tuple[int, Any]]]:
    """One message level as field number -> [(wire type, value)]: varints and fixed values as
    unsigned ints, length-delimited values as memoryviews of ``data``; at most ``max_fields`` values
    (a caller that knows its schema bounds the work a hostile message costs)."""
    if depth > MAX_DEPTH:
        raise WireError(f"protobuf: nesting deeper than {MAX_DEPTH}")
    buf = as_view(data)
    end = len(buf)
    pos = count = 0
    out: dict[int, list[tuple[int, Any]]] = {}
    while pos < end:
        key, pos = read_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if field == 0 or field > _MAX_FIELD:
            raise WireError(f"protobuf: invalid field number {field}")
        if wire == 0:
            value, pos = read_varint(buf, pos, end)
        elif wire == 1:
            if end - pos < 8:
                raise WireError("protobuf: truncated 64-bit value")
            value = int.from_bytes(buf[pos:pos + 8], "little")
            pos += 8
        elif wire == 5:
            if end - pos < 4:
                raise WireError("protobuf: truncated 32-bit value")
            value = int.from_bytes(buf[pos:pos + 4], "little")
            pos += 4
        elif wire == 2:
            length, pos = read_varint(buf, pos, end)
            if length > end - pos:
                raise WireError(f"protobuf: field {field} declares {length} bytes, "
                                f"only {end - pos} left")
            value = buf[pos:pos + length]
            pos += length
        else:
            raise WireError(f"protobuf: unsupported wire type {wire} (field {field})")
        out.setdefault(field, []).append((wire, value))
        count += 1
        if count > max_fields:
            raise WireError(f"protobuf: more than {max_fields} fields in one message")
    return out
