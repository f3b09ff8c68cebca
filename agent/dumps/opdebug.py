"""Opdebug (overflow debug) files: decode the overflow records and find the overflowing ops.

An Opdebug file (``Opdebug.Node_OpDebug.{task}.{stream}.{timestamp}``) uses the normal dump
container; ``output[0]`` holds the record (ascend-formats.md section 2.6), either the old
2048-byte record or the new one starting with u32 ``0x5A5A5A5A``. The task id in the debug file's
*name* is not the overflowing op's: the real task/stream ids are inside the record.

Status decoding extracts the bit field before the table lookup (precision_tool looks the whole
DHA status up instead of bits 8..15, and so never names a DHA atomic-add error).
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable

from .cann import parse_dump_name, read_container
from ..safeio import open_regular_file
from .types import DumpError, DumpTensor

log = logging.getLogger(__name__)

OLD_RECORD_SIZE = 2048
MAGIC = 0x5A5A5A5A
INVALID_ID = 65535
_U64_MAX = (1 << 64) - 1

AICORE_BITS = {0x8: "int_min_negation", 0x10: "int_overflow", 0x20: "float_overflow",
               0x80: "negative_to_unsigned", 0x100: "fp16_conversion_overflow",
               0x400: "cube_accumulation_overflow"}
DHA_CODES = {0x9: "overflow", 0xA: "underflow", 0xB: "src_nan", 0xC: "dst_nan", 0xD: "both_nan"}
L2_CODES = {1: "overflow", 2: "underflow", 3: "src_nan", 4: "dst_nan", 5: "both_nan"}
ACC_TYPES = {0: "AI Core", 1: "AI Vector", 2: "AI CPU", 3: "SDMA"}
_INFO = ("model_id", "stream_id", "task_id", "task_type", "pc_start", "para_base")
_NEW_FIELDS = {
    0: ("model_id", "stream_id", "task_id", "task_type", "context_id", "thread_id", "pc_start",
        "para_base", "core_id", "block_id"),
    2: ("model_id", "stream_id", "task_id", "task_type", "context_id", "cpu_id", "thread_id"),
    3: ("model_id", "stream_id", "task_id", "task_type", "context_id", "thread_id", "src_addr",
        "dst_addr", "channel_id"),
}
_NEW_FIELDS[1] = _NEW_FIELDS[0]


@dataclass(slots=True)
class OverflowRecord:
    task_id: int | None
    stream_id: int | None
    accelerator: str             # "AI Core", "DHA Atomic Add", "L2 Atomic Add", "AI Vector", ...
    status: int
    flags: tuple[str, ...]       # named status bits / codes, e.g. ("float_overflow",)
    model_id: int | None = None
    task_type: int | None = None
    context_id: int | None = None
    thread_id: int | None = None
    layout: str = "old"          # "old" (2048 bytes) | "new" (0x5A5A5A5A)
    path: str = ""
    timestamp: int | None = None  # from the debug file's name
    extra: dict[str, Any] = field(default_factory=dict)


def decode_status(accelerator: str, status: int) -> tuple[str, ...]:
    """Name the error(s) a status word encodes, per accelerator."""
    if accelerator in ("AI Core", "AI Vector"):
        names = [n for bit, n in AICORE_BITS.items() if status & bit]
        rest = status & ~sum(AICORE_BITS)
        return tuple(names + ([f"unknown_bits_0x{rest:x}"] if rest else []))
    if accelerator == "DHA Atomic Add":
        code = (status >> 8) & 0xFF
        return (DHA_CODES.get(code, f"unknown_code_0x{code:x}"),) if code else ()
    if accelerator == "L2 Atomic Add":
        code = (status >> 16) & 0x7
        return (L2_CODES.get(code, f"unknown_code_{code:03b}"),) if code else ()
    return (f"status_0x{status:x}",) if status else ()


def _id(v: int, invalid: tuple[int, ...] = (_U64_MAX,)) -> int | None:
    return None if v in invalid else v


def decode_record(data: bytes, name_meta: dict[str, Any] | None = None) -> list[OverflowRecord]:
    """Decode one record (old or new layout); one OverflowRecord per active (status != 0) unit.

    ``name_meta`` (the debug file's parsed name) supplies task/stream ids where the record has
    -1, as precision_tool does.
    """
    name_meta = name_meta or {}
    data = bytes(data)
    if len(data) >= 4 and struct.unpack_from("<I", data)[0] == MAGIC:
        recs = _decode_new(data)
    elif len(data) >= OLD_RECORD_SIZE:
        recs = _decode_old(data)
    else:
        raise DumpError(f"overflow record of {len(data)} bytes: neither the 2048-byte layout "
                        f"nor magic 0x{MAGIC:X}")
    for r in recs:
        if r.task_id is None or r.stream_id is None:
            r.extra["ids_from_file_name"] = True
            r.task_id = r.task_id if r.task_id is not None else name_meta.get("task_id")
            r.stream_id = r.stream_id if r.stream_id is not None else name_meta.get("stream_id")
    return recs


def _decode_old(data: bytes) -> list[OverflowRecord]:
    out = []
    units = (("DHA Atomic Add", 0, 512), ("L2 Atomic Add", 128, 768), ("AI Core", 256, 1024 + 16))
    for acc, info_at, status_at in units:
        status = struct.unpack_from("<Q", data, status_at)[0]
        if not status:
            continue
        info = dict(zip(_INFO, struct.unpack_from("<6Q", data, info_at)))
        extra = {"pc_start": hex(info["pc_start"]), "para_base": hex(info["para_base"])}
        if acc == "AI Core":
            code, block = struct.unpack_from("<2Q", data, 1024)
            extra.update(kernel_code=hex(code), block_idx=block)
        out.append(OverflowRecord(
            task_id=_id(info["task_id"]), stream_id=_id(info["stream_id"]), accelerator=acc,
            status=status, flags=decode_status(acc, status), model_id=_id(info["model_id"]),
            task_type=_id(info["task_type"]), layout="old", extra=extra))
    return out


def _decode_new(data: bytes) -> list[OverflowRecord]:
    if len(data) < 24:
        raise DumpError(f"new-layout overflow record truncated ({len(data)} bytes)")
    _, version, valid, acc_type, _, data_len = struct.unpack_from("<6I", data)
    if acc_type not in _NEW_FIELDS:
        raise DumpError(f"new-layout overflow record: unknown acc_type {acc_type}")
    names = _NEW_FIELDS[acc_type]
    n_status = 4 if version == 1 and acc_type in (0, 1) else 1
    need = (len(names) + n_status) * 8
    if data_len < need or data_len > len(data) - 24:
        raise DumpError(f"new-layout overflow record: data_len {data_len}, need {need}, "
                        f"have {len(data) - 24}")
    if valid != 1:
        return []
    values = struct.unpack_from(f"<{len(names) + n_status}Q", data, 24)
    info = dict(zip(names, values))
    words = values[len(names):]
    status = 0
    for w in words:                      # version 1 carries 4 status words: decode their union
        status |= w
    if not status:
        return []
    acc = ACC_TYPES[acc_type]
    extra = {k: v for k, v in info.items() if k not in ("model_id", "stream_id", "task_id",
                                                      "task_type", "context_id", "thread_id")}
    extra.update(version=version, status_words=list(words))
    invalid = (_U64_MAX, INVALID_ID)
    return [OverflowRecord(
        task_id=_id(info["task_id"]), stream_id=_id(info["stream_id"]), accelerator=acc,
        status=status, flags=decode_status(acc, status), model_id=_id(info["model_id"]),
        task_type=_id(info["task_type"]), context_id=_id(info["context_id"], invalid),
        thread_id=_id(info["thread_id"], invalid), layout="new", extra=extra)]


def read_opdebug(path: str) -> list[OverflowRecord]:
    """Overflow records of one Opdebug dump file (its ``output[0]``)."""
    meta = parse_dump_name(os.path.basename(path)) or {}
    _, segments, _ = read_container(path)
    outs = [(item, off) for kind, _, item, off in segments if kind == "output"]
    if not outs:
        raise DumpError(f"{path}: Opdebug file without an output")
    item, offset = outs[0]
    size = int(item.get("size", 0))
    try:
        with open_regular_file(path) as fh:
            fh.seek(offset)
            data = fh.read(min(size, 1 << 20))
    except OSError as exc:
        raise DumpError(f"{path}: {exc.strerror or exc}") from exc
    try:
        recs = decode_record(data, meta)
    except DumpError as exc:
        raise DumpError(f"{path}: {exc}") from exc
    for r in recs:
        r.path, r.timestamp = path, meta.get("timestamp")
    return recs


@dataclass(slots=True)
class OverflowOp:
    """One overflow record and the dump of the op that overflowed (None when not found)."""

    record: OverflowRecord
    debug_file: str
    op_name: str | None = None
    op_type: str | None = None
    path: str | None = None
    tensors: list[DumpTensor] = field(default_factory=list)


def find_overflow_ops(opdebug_files: Iterable[str], dump_tensors: Iterable[DumpTensor],
                      limit: int | None = None, errors: list[tuple[str, str]] | None = None,
                      ) -> list[OverflowOp]:
    """Map overflow records to the overflowing ops' own dump files, first overflow first.

    Debug files are ordered by the timestamp in their names (numerically); ``limit`` keeps the
    first N files. A record matches a non-Opdebug dump file with the record's task_id and
    stream_id (and context/thread ids when both sides have them); among several, the one whose
    timestamp is nearest the debug file's wins, ties to the earliest. Unreadable debug files go
    to ``errors`` as (path, reason).
    """
    files = []
    for p in opdebug_files:
        meta = parse_dump_name(os.path.basename(p))
        files.append(((meta or {}).get("timestamp", 1 << 64), os.path.basename(p), p))
    files.sort()
    by_file: dict[str, list[DumpTensor]] = {}
    for t in dump_tensors:
        if not t.extra.get("is_opdebug"):
            by_file.setdefault(t.path, []).append(t)
    by_task: dict[Any, list[str]] = {}   # task id -> dump files: a lookup, not a pass over all files
    for path, ts_list in by_file.items():
        by_task.setdefault(ts_list[0].extra.get("task_id"), []).append(path)
    out: list[OverflowOp] = []
    for ts, _, p in files[:limit]:
        try:
            records = read_opdebug(p)
        except DumpError as exc:
            log.warning("skipping Opdebug file: %s", exc)
            if errors is not None:
                errors.append((p, str(exc)))
            continue
        for rec in records:
            best = None
            for path in by_task.get(rec.task_id, ()) if rec.task_id is not None else ():
                e = by_file[path][0].extra
                if not _matches(rec, e):
                    continue
                key = (abs(e.get("timestamp", 0) - (ts if ts < 1 << 64 else 0)),
                       e.get("timestamp", 0), path)
                if best is None or key < best[0]:
                    best = (key, path)
            op = OverflowOp(record=rec, debug_file=p)
            if best is not None:
                ts_list = by_file[best[1]]
                op.path, op.op_name, op.op_type = best[1], ts_list[0].name, ts_list[0].op_type
                op.tensors = ts_list
            out.append(op)
    return out


def _matches(rec: OverflowRecord, e: dict[str, Any]) -> bool:
    if rec.task_id is None or e.get("task_id") != rec.task_id:
        return False
    if rec.stream_id is not None and e.get("stream_id") is not None \
            and e["stream_id"] != rec.stream_id:
        return False
    for k in ("context_id", "thread_id"):
        if getattr(rec, k) is not None and e.get(k) is not None and e[k] != getattr(rec, k):
            return False
    return True
