"""Read a ``torch.save`` zip archive (one tensor) without torch and without running its pickle.

A torch.save file is a zip with one top-level folder holding ``data.pkl`` (pickle protocol 2)
and ``data/<key>`` (raw storage bytes). For a plain tensor, the pickle names only
``torch._utils._rebuild_tensor_v2``, one ``torch.<X>Storage`` type and ``collections.OrderedDict``,
and refers to the storage through a persistent id ``('storage', <type>, key, location, numel)``.

Our unpickler maps exactly those globals to inert local stand-ins (plus ``_rebuild_parameter``,
which wraps a tensor in ``nn.Parameter``). Any other global stops the read with
``DumpError("pickle asks for forbidden global X")`` before anything else happens. The result is a
description (storage key, dtype, offset, size, stride), checked against the storage member;
``load`` then views the member bytes with numpy (memory-mapped when stored uncompressed).
bfloat16 data comes back as raw uint16 words with dtype name "bfloat16".
"""

from __future__ import annotations

import collections
import functools
import io
import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass

import numpy as np

from ..safeio import memmap_regular
from .npy import SLACK, member_array, open_zip, read_member, stored_data_offset
from .types import DumpError, DumpTensor, FileRegion, ZipRegion

MAX_PICKLE = 1 << 20
MAX_ELEMENTS = 1 << 34

# storage type name -> (numpy dtype, dtype name we report)
STORAGE_DTYPES: dict[str, tuple[str, str]] = {
    "FloatStorage": ("<f4", "float32"), "DoubleStorage": ("<f8", "float64"),
    "HalfStorage": ("<f2", "float16"), "BFloat16Storage": ("<u2", "bfloat16"),
    "LongStorage": ("<i8", "int64"), "IntStorage": ("<i4", "int32"),
    "ShortStorage": ("<i2", "int16"), "CharStorage": ("i1", "int8"),
    "ByteStorage": ("u1", "uint8"), "BoolStorage": ("?", "bool"),
    "ComplexFloatStorage": ("<c8", "complex64"), "ComplexDoubleStorage": ("<c16", "complex128"),
}


class _StorageType:
    """Stand-in for ``torch.<X>Storage``: an inert, non-callable, non-class marker."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True, slots=True)
class _Storage:
    key: str
    stype: str          # storage type name, copied at load time
    numel: int


@dataclass(frozen=True, slots=True)
class TensorRef:
    """What data.pkl describes: a view of one storage."""

    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int for v in value):
        raise DumpError(f"data.pkl: {what} is not a tuple of ints: {value!r}"[:200])
    return tuple(value)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None) -> TensorRef:
    if not isinstance(storage, _Storage):
        raise DumpError("data.pkl: tensor rebuilt from something that is not a storage")
    if type(storage_offset) is not int or storage_offset < 0:
        raise DumpError(f"data.pkl: bad storage offset {storage_offset!r}"[:200])
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride) or any(d < 0 for d in size) or any(s < 0 for s in stride):
        raise DumpError(f"data.pkl: bad size/stride {size}/{stride}")
    return TensorRef(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise DumpError("data.pkl: parameter rebuilt from something that is not a tensor")
    return data


def _allowed() -> dict[tuple[str, str], object]:
    """Fresh stand-ins for each unpickler, so a pickle that mutates one (BUILD) cannot affect
    the next read."""
    table: dict[tuple[str, str], object] = {
        ("torch._utils", "_rebuild_tensor_v2"): functools.partial(_rebuild_tensor_v2),
        ("torch._utils", "_rebuild_parameter"): functools.partial(_rebuild_parameter),
        ("collections", "OrderedDict"): collections.OrderedDict,
    }
    table.update({("torch", n): _StorageType(n) for n in STORAGE_DTYPES})
    return table

_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")


class _Unpickler(pickle.Unpickler):
    def __init__(self, fp) -> None:
        super().__init__(fp)
        self._allowed = _allowed()

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle hook
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise DumpError(f"pickle asks for forbidden global {module}.{name}") from None

    def persistent_load(self, pid):
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or pid[1].name not in STORAGE_DTYPES or not isinstance(pid[2], str)
                or not _KEY.fullmatch(pid[2]) or type(pid[4]) is not int or pid[4] < 0):
            raise DumpError(f"data.pkl: unsupported persistent id {pid!r}"[:200])
        return _Storage(pid[2], pid[1].name, pid[4])


def unpickle_tensor(data: bytes, what: str = "data.pkl") -> TensorRef:
    try:
        obj = _Unpickler(io.BytesIO(data)).load()
    except DumpError as exc:
        raise DumpError(f"{what}: {exc}") from None
    except RecursionError:
        raise DumpError(f"{what}: pickle nests too deeply") from None
    except Exception as exc:  # UnpicklingError, EOFError, TypeError from a stand-in, ...
        raise DumpError(f"{what}: bad pickle: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(obj, TensorRef):
        raise DumpError(f"{what}: top-level object is {type(obj).__name__}, not a single tensor")
    return obj


@dataclass(frozen=True)
class PtInfo:
    path: str
    dtype: str                  # reported name ("bfloat16" for raw uint16 words)
    np_dtype: np.dtype
    shape: tuple[int, ...]
    ref: TensorRef
    member: zipfile.ZipInfo
    data_offset: int | None = None   # where a stored (uncompressed) member's bytes start: load maps it directly


def inspect_pt(path: str | os.PathLike, *, max_members: int = 64,
               max_uncompressed: int = 8 << 30) -> PtInfo:
    """Parse the archive and data.pkl; check the view fits the storage. Reads no tensor data."""
    path = os.fspath(path)
    with open_zip(path, max_members=max_members, max_uncompressed=max_uncompressed) as zf:
        infos = {i.filename: i for i in zf.infolist()}
        pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise DumpError(f"{path}: expected one <dir>/data.pkl in the zip, found {len(pkls)}")
        prefix = pkls[0][: -len("data.pkl")]
        ref = unpickle_tensor(read_member(path, zf, infos[pkls[0]], MAX_PICKLE), f"{path}:{pkls[0]}")
        order = infos.get(prefix + "byteorder")
        big = order is not None and read_member(path, zf, order, 16).strip() == b"big"
        member = infos.get(f"{prefix}data/{ref.storage.key}")
        if member is None:
            raise DumpError(f"{path}: storage member {prefix}data/{ref.storage.key} is missing")
        # found while the archive is open, so that loading does not parse the zip a second time
        data_offset = stored_data_offset(path, zf, member) if member.compress_type == zipfile.ZIP_STORED else None
    np_code, name = STORAGE_DTYPES[ref.storage.stype]
    dtype = np.dtype(np_code)
    if big:
        dtype = dtype.newbyteorder(">")
    numel = ref.storage.numel
    if numel * dtype.itemsize > member.file_size:
        raise DumpError(f"{path}: storage declares {numel} elements, member has {member.file_size} bytes")
    if member.file_size > numel * dtype.itemsize + SLACK:  # checked before anything is inflated
        raise DumpError(f"{path}: storage member declares {member.file_size} bytes, its {numel} elements "
                        f"need only {numel * dtype.itemsize}; refused")
    if len(ref.size) > 64 or math.prod(ref.size) > MAX_ELEMENTS:
        raise DumpError(f"{path}: tensor of shape {ref.size} is too large"[:300])
    if all(ref.size):
        last = ref.offset + sum((d - 1) * s for d, s in zip(ref.size, ref.stride))
        if last >= numel:
            raise DumpError(f"{path}: tensor view reaches element {last} of a {numel}-element storage")
    return PtInfo(path, name, dtype, ref.size, ref, member, data_offset)


def load_pt(info: PtInfo, limit: int = 8 << 30) -> np.ndarray:
    """The tensor as a read-only numpy array (a view of a memory map when stored)."""
    ref = info.ref
    if not all(ref.size):
        return np.empty(ref.size, dtype=info.np_dtype)
    if info.data_offset is not None:
        try:
            flat = memmap_regular(info.path, info.np_dtype, info.data_offset, ref.storage.numel)
        except (OSError, ValueError) as exc:   # the file shrank since it was inspected, or was replaced
            raise DumpError(f"{info.path}: cannot map the tensor data: {exc}") from None
    else:
        flat = member_array(info.path, info.member, info.np_dtype, ref.storage.numel, 0, limit)
    itemsize = info.np_dtype.itemsize
    contiguous = _contiguous(ref)
    count = math.prod(ref.size)
    if contiguous:
        arr = flat[ref.offset: ref.offset + count].reshape(ref.size)
    else:
        arr = np.lib.stride_tricks.as_strided(
            flat[ref.offset:], shape=ref.size, strides=tuple(s * itemsize for s in ref.stride),
            writeable=False)
    if isinstance(arr, np.ndarray) and arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr


def _contiguous(ref: TensorRef) -> bool:
    expect = 1
    for d, s in zip(reversed(ref.size), reversed(ref.stride)):
        if d != 1 and s != expect:
            return False
        expect *= d
    return True


def pt_region(info: PtInfo) -> FileRegion | ZipRegion | None:
    """Where the tensor's elements lie in the file, for the scanner's bounded reads; None for a
    non-contiguous view (the scanner then walks ``load_pt``'s strided view)."""
    ref = info.ref
    if not _contiguous(ref):
        return None
    count, skip = math.prod(ref.size), ref.offset * info.np_dtype.itemsize
    if info.data_offset is not None:
        return FileRegion(info.path, info.data_offset + skip, info.np_dtype, count, ref.size)
    return ZipRegion(info.path, info.member.filename, skip, info.np_dtype, count, ref.size)


def read_pt(path: str | os.PathLike, *, name: str | None = None) -> DumpTensor:
    info = inspect_pt(path)
    stem = name if name is not None else os.path.basename(info.path).removesuffix(".pt")
    return DumpTensor(name=stem, io="", index=0, dtype=info.dtype, shape=info.shape, order=0,
                      path=info.path, load=lambda: load_pt(info), region=lambda: pt_region(info))
