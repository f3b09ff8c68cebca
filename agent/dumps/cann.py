"""CANN (Ascend GE/ACL) binary dump files: names, "version 2" container, directory listing.

Layout (ascend-formats.md section 2.3): ``[u64 LE header_len][DumpData protobuf][input bytes...]
[output bytes...][buffer bytes...][space bytes...]``; the declared sizes must add up to the file
size exactly. Tensor bytes are in the device format. For device formats (NC1HWC0, FRACTAL_Z,
FRACTAL_NZ, ...) ``load()`` returns the stored elements as a flat array **including the layout
padding** (``extra["padded"]`` is True): statistics such as NaN/Inf counts, min and max do not
depend on the layout, but padding zeros do enter means and zero fractions.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import re
from typing import Any, Callable

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from .protobuf import decode_dump_data
from ..safeio import memmap_regular, open_regular_file
from .types import DumpError, DumpTensor, FileRegion

log = logging.getLogger(__name__)

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_EXTRA_FIELDS = ("task_type", "context_id", "thread_id", "device_id")

# CANN OutputDataType -> (our dtype name, little-endian numpy dtype)
DTYPES: dict[int, tuple[str, str]] = {
    1: ("float32", "<f4"), 2: ("float16", "<f2"), 3: ("int8", "i1"), 4: ("uint8", "u1"),
    5: ("int16", "<i2"), 6: ("uint16", "<u2"), 7: ("int32", "<i4"), 8: ("int64", "<i8"),
    9: ("uint32", "<u4"), 10: ("uint64", "<u8"), 11: ("bool", "?"), 12: ("float64", "<f8"),
    27: ("bfloat16", "<u2"),
}
DTYPE_NAMES = {0: "DT_UNDEFINED", 13: "DT_STRING", 16: "DT_COMPLEX64", 17: "DT_COMPLEX128",
               28: "DT_INT4", 29: "DT_UINT1", 30: "DT_INT2", 31: "DT_UINT2", 32: "DT_COMPLEX32",
               33: "DT_HIFLOAT8", 34: "DT_FLOAT8_E5M2", 35: "DT_FLOAT8_E4M3FN"}
FORMATS = {0: "NCHW", 1: "NHWC", 2: "ND", 3: "NC1HWC0", 4: "FRACTAL_Z", 16: "HWCN",
           29: "FRACTAL_NZ", 30: "NCDHW", 32: "NDC1HWC0", 33: "FRACTAL_Z_3D"}
HOST_FORMATS = frozenset({0, 1, 2, 16, 30})   # layouts whose bytes are the plain tensor
MAX_HEADER = 16 << 20       # real DumpData headers are a few KiB


def parse_dump_name(filename: str) -> dict[str, Any] | None:
    """Parse a CANN dump file name; None when it is not one.

    Forms: ``op_type.op_name.task_id[.stream_id].timestamp`` and the FFTS form with
    ``.task_type.context_id.thread_id[.device_id]`` after the timestamp. Op names never contain
    dots (CANN replaces ``.``, ``/``, ``\\`` and space by ``_``), so the name splits on dots.
    """
    parts = os.path.basename(filename).split(".")
    if len(parts) < 4 or not all(p and set(p) <= _NAME_CHARS for p in parts[:2]):
        return None
    nums = parts[2:]
    if not all(p.isdigit() and p.isascii() for p in nums):
        return None
    # the timestamp is the first field after task_id with 13+ digits (16 in practice);
    # failing that it is positional: task.ts or task.stream.ts
    ts_at = next((i for i in (1, 2) if i < len(nums) and len(nums[i]) >= 13), None)
    if ts_at is None:
        ts_at = 1 if len(nums) == 2 else 2
    extra = nums[ts_at + 1:]
    if ts_at >= len(nums) or len(extra) not in (0, 3, 4):
        return None
    out: dict[str, Any] = {
        "op_type": parts[0], "op_name": parts[1], "task_id": int(nums[0]),
        "stream_id": int(nums[1]) if ts_at == 2 else None, "timestamp": int(nums[ts_at]),
        "ffts": bool(extra),
    }
    out.update({k: int(v) for k, v in zip(_EXTRA_FIELDS, extra)})
    out["is_opdebug"] = (parts[0].lower() == "opdebug" and parts[1].lower() == "node_opdebug")
    return out


_TIME_DIR = re.compile(r"(?:19|20)\d{12}")      # YYYYMMDDHHMMSS
_RANK_DIR = re.compile(r"rank_?(\d+)")
_STEP_DIR = re.compile(r"step_?(\d+)")


def dump_dir_location(directory: str) -> tuple[int | None, int | None]:
    """(step, rank) of a CANN dump directory, read from its path (ascend-formats.md §2.2).

    GE/ACL ``{time}/{device_id}/{model_name}/{model_id}/{data_index}`` gives rank = device id
    and step = data index (the iteration); single-op ``{time}/{device_id}`` gives the rank only;
    msprobe's ``rank_{r}/…/step_{s}/…`` and MindSpore's ``rank_{r}/{net}/{graph}/{iteration}``
    name them outright (a ``rank_`` directory is the global rank and wins over a device id).
    Unknown layouts give (None, None): the dump is then one step of one rank.
    """
    parts = os.path.abspath(directory).split(os.sep)
    step = rank = None
    for i in range(len(parts) - 1, -1, -1):           # the innermost time directory
        if _TIME_DIR.fullmatch(parts[i]):
            tail = parts[i + 1:]
            if tail and tail[0].isdigit():
                rank = int(tail[0])
                if len(tail) == 4 and tail[2].isdigit() and tail[3].isdigit():
                    step = int(tail[3])
            break
    rank_at = None
    for i, part in enumerate(parts):
        if m := _RANK_DIR.fullmatch(part):
            rank, rank_at = int(m.group(1)), i
        elif m := _STEP_DIR.fullmatch(part):
            step = int(m.group(1))
    if rank_at is not None and rank_at == len(parts) - 4 and parts[-1].isdigit() and step is None:
        step = int(parts[-1])                          # MindSpore rank_{r}/{net}/{graph}/{iteration}
    return step, rank


def read_mapping_csv(path: str) -> dict[str, str]:
    """``mapping.csv`` rows ``short_name,original_name`` -> {short: original}; bad rows skipped."""
    out: dict[str, str] = {}
    with open_regular_file(path, "r", newline="", encoding="utf-8", errors="replace") as fh:
        for row in csv.reader(fh):
            if len(row) >= 2 and row[0].strip() and row[1].strip():
                out[os.path.basename(row[0].strip())] = os.path.basename(row[1].strip())
    return out


def read_container(path: str) -> tuple[dict[str, Any], list[tuple[str, int, dict, int]], int]:
    """Read and check the header; return (DumpData dict, segments, file size).

    Each segment is (kind, index, message, byte offset); kinds in file order: input, output,
    buffer, space. Raises DumpError when the sizes do not add up to the file size exactly.
    """
    try:
        with open_regular_file(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size <= 8:
                raise DumpError(f"{path}: {size} bytes, too short for a dump file")
            hlen = int.from_bytes(fh.read(8), "little")
            if hlen > size - 8:
                raise DumpError(f"{path}: header length {hlen} exceeds the file ({size} bytes)")
            if hlen > MAX_HEADER:
                raise DumpError(f"{path}: header length {hlen} is implausibly large")
            header = fh.read(hlen)
    except OSError as exc:
        raise DumpError(f"{path}: {exc.strerror or exc}") from exc
    if len(header) != hlen:
        raise DumpError(f"{path}: file changed while reading")
    try:
        msg = decode_dump_data(header)
    except DumpError as exc:
        raise DumpError(f"{path}: bad DumpData header: {exc}") from exc
    segments = []
    offset = 8 + hlen
    for kind in ("input", "output", "buffer", "space"):
        for i, item in enumerate(msg[kind]):
            segments.append((kind, i, item, offset))
            offset += int(item.get("size", 0))
    if offset != size:
        raise DumpError(f"{path}: header + declared sizes = {offset} bytes, file has {size}")
    return msg, segments, size


def _loader(path: str, np_dtype: str, offset: int, count: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=np_dtype)
        try:
            return memmap_regular(path, np_dtype, offset, count)
        except (OSError, ValueError) as exc:
            raise DumpError(f"{path}: cannot map: {exc}") from None
    return load


def _shaped(load: Callable[[], np.ndarray], shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    return lambda: load().reshape(shape)


def read_cann_dump_ex(path: str, mapping: dict[str, str] | None = None, order: int = 0,
                      ) -> tuple[list[DumpTensor], list[str]]:
    """Like :func:`read_cann_dump`, also returning the reasons for skipped tensors."""
    base = os.path.basename(path)
    real = (mapping or {}).get(base, base)
    meta = parse_dump_name(real) or {}
    msg, segments, _ = read_container(path)
    tensors: list[DumpTensor] = []
    skipped: list[str] = []
    for kind, idx, item, offset in segments:
        if kind not in ("input", "output"):
            continue
        code = int(item.get("data_type", 0))
        nbytes = int(item.get("size", 0))
        if code not in DTYPES:
            skipped.append(f"{kind} {idx}: unsupported data type "
                           f"{DTYPE_NAMES.get(code, code)}")
            continue
        dname, np_dtype = DTYPES[code]
        itemsize = np.dtype(np_dtype).itemsize
        if nbytes % itemsize:
            raise DumpError(f"{path}: {kind} {idx} size {nbytes} is not a multiple of "
                            f"{itemsize} ({dname})")
        count = nbytes // itemsize
        fmt = int(item.get("format", 2))
        device_shape = tuple(int(d) for d in item.get("shape", {}).get("dim", []))
        orig = item.get("original_shape", {}).get("dim", [])
        shape = tuple(int(d) for d in orig) if orig else device_shape
        load = _loader(path, np_dtype, offset, count)
        padded = False
        loaded_shape: tuple[int, ...] = (count,)
        if fmt in HOST_FORMATS and math.prod(shape) == count and len(shape) <= 32:
            load, loaded_shape = _shaped(load, shape), shape
        elif fmt in HOST_FORMATS and device_shape and math.prod(device_shape) == count \
                and len(device_shape) <= 32:
            load, loaded_shape = _shaped(load, device_shape), device_shape
        else:
            padded = fmt not in HOST_FORMATS and math.prod(shape) != count
        region = FileRegion(path, offset, np.dtype(np_dtype), count, loaded_shape)
        extra = {"format": FORMATS.get(fmt, str(fmt)), "device_shape": device_shape,
                 "padded": padded, "nbytes": nbytes, "offset": offset,
                 "proto_op_name": msg.get("op_name", "")}
        extra.update({k: meta[k] for k in ("task_id", "stream_id", "timestamp", "is_opdebug",
                                            *_EXTRA_FIELDS) if k in meta})
        if real != base:
            extra["file_name"] = real
        tensors.append(DumpTensor(
            name=meta.get("op_name") or msg.get("op_name") or base, io=kind, index=idx,
            dtype=dname, shape=shape, order=order, path=path, op_type=meta.get("op_type", ""),
            load=load, extra=extra, region=lambda r=region: r))
    return tensors, skipped


def read_cann_dump(path: str, mapping: dict[str, str] | None = None, order: int = 0,
                   ) -> list[DumpTensor]:
    """One DumpTensor per input and output of one dump file (unsupported dtypes are skipped).

    ``mapping`` maps shortened file names to their real names (see :func:`read_mapping_csv`).
    """
    return read_cann_dump_ex(path, mapping, order)[0]


def list_dump_files(directory: str, mapping: dict[str, str] | None = None,
                    ) -> list[tuple[str, dict[str, Any]]]:
    """(path, parsed name) of every dump file in ``directory``, sorted by timestamp, then name.

    Non-dump files are skipped; a file reachable under two names (precision_tool leaves a
    symlink at the shortened name) is listed once.
    """
    if mapping is None:
        mp = os.path.join(directory, "mapping.csv")
        mapping = read_mapping_csv(mp) if os.path.isfile(mp) else {}
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        meta = parse_dump_name(mapping.get(entry, entry))
        if meta is None or os.path.isdir(path) or not os.path.exists(path):
            continue  # a FIFO or device under a dump name is kept: reading it reports it, never blocks
        key = os.path.realpath(path)
        if key not in found or os.path.islink(found[key][0]):
            found[key] = (path, meta)
    return sorted(found.values(), key=lambda pm: (pm[1]["timestamp"], os.path.basename(pm[0])))


def list_dump_dir(directory: str, mapping: dict[str, str] | None = None,
                  include_opdebug: bool = False,
                  ) -> tuple[list[DumpTensor], list[tuple[str, str]]]:
    """All tensors of the dump files of one directory in timestamp order, plus (path, reason)
    for each file or tensor that could not be read. Opdebug files are left out unless asked."""
    if mapping is None:
        mp = os.path.join(directory, "mapping.csv")
        try:
            mapping = read_mapping_csv(mp) if os.path.isfile(mp) else {}
        except OSError as exc:
            log.warning("cannot read %s: %s", mp, exc)
            mapping = {}
    tensors: list[DumpTensor] = []
    errors: list[tuple[str, str]] = []
    order = 0
    for path, meta in list_dump_files(directory, mapping):
        if meta["is_opdebug"] and not include_opdebug:
            continue
        try:
            got, skipped = read_cann_dump_ex(path, mapping, order)
        except DumpError as exc:
            log.warning("skipping dump file: %s", exc)
            errors.append((path, str(exc)))
            continue
        errors.extend((path, reason) for reason in skipped)
        tensors.extend(got)
        order += 1
    return tensors, errors
