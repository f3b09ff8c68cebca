"""The ``DumpData`` schema of CANN dumps over the shared defensive wire decoder (``protowire``).
Hostile input raises :class:`DumpError`, nothing else. Schema (``toolkit.dumpdata``):
ascend-formats.md section 2.4.
"""

from __future__ import annotations

from typing import Any

from .. import protowire
from ..protowire import MAX_FIELDS, WireError
from .types import DumpError


def read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """Decode one varint at ``pos``; return (value, next position)."""
    try:
        return protowire.read_varint(buf, pos, end)
    except WireError as exc:
        raise DumpError(str(exc)) from None


def decode_fields(data: bytes | memoryview, depth: int = 0) -> dict[int, list[Any]]:
    """Decode one message level into field number -> list of raw values.

    Varints and fixed values come back as unsigned ints, length-delimited values as memoryviews.
    """
    return {f: [v for _, v in vals] for f, vals in decode_wire(data, depth).items()}


def decode_wire(data: bytes | memoryview, depth: int = 0) -> dict[int, list[tuple[int, Any]]]:
    """Like :func:`decode_fields`, but each value comes with its wire type: (wire, value)."""
    try:
        return protowire.decode_wire(data, depth)
    except WireError as exc:
        raise DumpError(str(exc)) from None


# --- schema-driven decoding -------------------------------------------------------------------
# A schema maps field number -> (name, kind, repeated, sub-schema). Kinds: "uint", "int32",
# "string", "bytes", "message", "uint_list" (repeated uint64, packed or not).

Schema = dict[int, tuple[str, str, bool, Any]]


def _scalar(kind: str, wire: int, value: Any, name: str) -> Any:
    if kind in ("uint", "int32"):
        if wire not in (0, 1, 5):
            raise DumpError(f"protobuf: field {name!r} expected a number, got wire type {wire}")
        if kind == "int32" and wire == 0 and value >= 1 << 63:
            value -= 1 << 64          # negative int32/int64 is sign-extended to 10 bytes
        return value
    if wire != 2:
        raise DumpError(f"protobuf: field {name!r} expected bytes, got wire type {wire}")
    if kind == "string":
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DumpError(f"protobuf: field {name!r} is not UTF-8") from exc
    return value                      # "bytes": a memoryview, no copy


def decode_message(data: bytes | memoryview, schema: Schema, depth: int = 0) -> dict[str, Any]:
    """Decode ``data`` with ``schema``; unknown fields are ignored, absent ones left out."""
    fields = decode_wire(data, depth)
    msg: dict[str, Any] = {}
    for number, values in fields.items():
        spec = schema.get(number)
        if spec is None:
            continue
        name, kind, repeated, sub = spec
        decoded: list[Any] = []
        for wire, value in values:
            if kind == "message":
                if wire != 2:
                    raise DumpError(f"protobuf: field {name!r} expected a message")
                decoded.append(decode_message(value, sub, depth + 1))
            elif kind == "uint_list":
                if wire == 2:         # packed
                    pos, end = 0, len(value)
                    while pos < end:
                        v, pos = read_varint(value, pos, end)
                        decoded.append(v)
                        if len(decoded) > MAX_FIELDS:
                            raise DumpError(f"protobuf: more than {MAX_FIELDS} packed values")
                else:
                    decoded.append(_scalar("uint", wire, value, name))
            else:
                decoded.append(_scalar(kind, wire, value, name))
        if repeated or kind == "uint_list":
            msg.setdefault(name, []).extend(decoded)
        elif decoded:
            msg[name] = decoded[-1]   # proto semantics: the last one wins
    return msg


SHAPE: Schema = {1: ("dim", "uint_list", True, None)}
DIM_RANGE: Schema = {1: ("dim_start", "uint", False, None), 2: ("dim_end", "uint", False, None)}
ORIGINAL_OP: Schema = {1: ("name", "string", False, None), 2: ("output_index", "uint", False, None),
                       3: ("data_type", "uint", False, None), 4: ("format", "uint", False, None)}
OP_OUTPUT: Schema = {
    1: ("data_type", "uint", False, None), 2: ("format", "uint", False, None),
    3: ("shape", "message", False, SHAPE), 4: ("original_op", "message", False, ORIGINAL_OP),
    5: ("data", "bytes", False, None), 6: ("size", "uint", False, None),
    7: ("original_shape", "message", False, SHAPE), 8: ("sub_format", "int32", False, None),
    9: ("address", "uint", False, None), 10: ("dim_range", "message", True, DIM_RANGE),
    11: ("offset", "uint", False, None),
}
OP_INPUT: Schema = {
    1: ("data_type", "uint", False, None), 2: ("format", "uint", False, None),
    3: ("shape", "message", False, SHAPE), 4: ("data", "bytes", False, None),
    5: ("size", "uint", False, None), 6: ("original_shape", "message", False, SHAPE),
    7: ("sub_format", "int32", False, None), 8: ("address", "uint", False, None),
    9: ("offset", "uint", False, None),
}
OP_BUFFER: Schema = {1: ("buffer_type", "uint", False, None), 2: ("data", "bytes", False, None),
                     3: ("size", "uint", False, None)}
OP_ATTR: Schema = {1: ("name", "string", False, None), 2: ("value", "string", False, None)}
WORKSPACE: Schema = {1: ("type", "uint", False, None), 2: ("data", "bytes", False, None),
                     3: ("size", "uint", False, None)}
DUMP_DATA: Schema = {
    1: ("version", "string", False, None), 2: ("dump_time", "uint", False, None),
    3: ("output", "message", True, OP_OUTPUT), 4: ("input", "message", True, OP_INPUT),
    5: ("buffer", "message", True, OP_BUFFER), 6: ("op_name", "string", False, None),
    7: ("attr", "message", True, OP_ATTR), 8: ("space", "message", True, WORKSPACE),
}


def decode_dump_data(data: bytes | memoryview) -> dict[str, Any]:
    """Decode a ``toolkit.dumpdata.DumpData`` header into plain dicts and lists.

    Repeated fields (``input``, ``output``, ``buffer``, ``attr``, ``space``) are always present
    as lists; a ``shape``/``original_shape`` is a dict with a ``dim`` list when present.
    """
    msg = decode_message(data, DUMP_DATA)
    for key in ("input", "output", "buffer", "attr", "space"):
        msg.setdefault(key, [])
    for t in msg["input"] + msg["output"]:
        for key in ("shape", "original_shape"):
            if key in t:
                t[key].setdefault("dim", [])
    return msg
