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
import mmap
import os
import pickle
import re
import stat
import sys
import zipfile
from typing import NamedTuple

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from ..safeio import memmap_regular
from .npy import SLACK, member_array, open_zip, read_member, stored_data_offset
from .storedzip import Member, read_stored_zip
from .types import DumpError, DumpTensor, FileRegion, RawTensor, ZipRegion

MAX_PICKLE = 1 << 20
MAX_ELEMENTS = 1 << 34
_MAP_HERE = 8 << 20   # tensors up to this size are mapped with the descriptor that read the zip
RAW_MAX_BYTES = 64 << 20   # open_pt_raw's tensors: as kernels/compare_c.WHOLE_MAPPED_BYTES (larger: np.memmap
                           # read block by block, its pages dropped from the RSS behind the compare)

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


# The descriptions are NamedTuples (immutable, so the cache below can share them): one is built
# at every start of a command that reads a dump, and a dataclass costs ~5x more to define.
class _Storage(NamedTuple):
    key: str
    stype: str          # storage type name, copied at load time
    numel: int


class TensorRef(NamedTuple):
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


_GLOBALS: dict[tuple[str, str], object] = {
    ("torch._utils", "_rebuild_tensor_v2"): lambda: functools.partial(_rebuild_tensor_v2),
    ("torch._utils", "_rebuild_parameter"): lambda: functools.partial(_rebuild_parameter),
    ("collections", "OrderedDict"): lambda: collections.OrderedDict,
    **{("torch", n): (lambda n=n: _StorageType(n)) for n in STORAGE_DTYPES},
}


_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D401 - pickle hook
        """A fresh stand-in per lookup, so a pickle that mutates one (BUILD) cannot affect
        another lookup or the next read."""
        try:
            make = _GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise DumpError(f"pickle asks for forbidden global {module}.{name}") from None
        return make()

    def persistent_load(self, pid):
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or pid[1].name not in STORAGE_DTYPES or not isinstance(pid[2], str)
                or not _KEY.fullmatch(pid[2]) or type(pid[4]) is not int or pid[4] < 0):
            raise DumpError(f"data.pkl: unsupported persistent id {pid!r}"[:200])
        return _Storage(pid[2], pid[1].name, pid[4])


def unpickle_tensor(data: bytes, what: str = "data.pkl") -> TensorRef:
    try:
        return _known(data) if len(data) <= 4096 else _unpickle(data)   # the cache holds small ones only
    except DumpError as exc:
        raise DumpError(f"{what}: {exc}") from None


@functools.lru_cache(maxsize=512)
def _known(data: bytes) -> TensorRef:
    """The description of ``data`` (immutable, so shared): the tensors of a dump repeat a few
    shapes, and the same pickle bytes describe the same view; unpickling is ~half of a small
    tensor's read."""
    return _unpickle(data)


def _unpickle(data: bytes) -> TensorRef:
    try:
        obj = _Unpickler(io.BytesIO(data)).load()
    except DumpError:
        raise
    except RecursionError:
        raise DumpError("pickle nests too deeply") from None
    except Exception as exc:  # UnpicklingError, EOFError, TypeError from a stand-in, ...
        raise DumpError(f"bad pickle: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(obj, TensorRef):
        raise DumpError(f"top-level object is {type(obj).__name__}, not a single tensor")
    return obj


class PtInfo(NamedTuple):
    path: str
    dtype: str                  # reported name ("bfloat16" for raw uint16 words)
    code: str                   # numpy's dtype string of the stored words, byte order first ("<f4", ">f2", "?")
    shape: tuple[int, ...]
    ref: TensorRef
    member: zipfile.ZipInfo | Member   # the fast path's Member (name, size) where data_offset is set
    data_offset: int | None = None   # where a stored (uncompressed) member's bytes start: load maps it directly

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.code.lstrip("<>|")]

    @property
    def np_dtype(self) -> np.dtype:
        """The stored words' numpy dtype (built when asked: reading a .pt's description needs no numpy)."""
        return np.dtype(self.code)


_ITEMSIZE = {"f4": 4, "f8": 8, "f2": 2, "u2": 2, "i8": 8, "i4": 4, "i2": 2, "i1": 1, "u1": 1, "?": 1, "c8": 8, "c16": 16}
# the C compare kernel's words (kernels/compare_c.py): reported dtype -> (RawTensor code, memoryview format, size)
_RAW_KINDS = {"float32": ("f4", "f", 4), "float16": ("f2", "H", 2), "bfloat16": ("bf16", "H", 2)}


def raw_may_take(dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether :func:`open_pt_raw` can give a tensor declared ``dtype`` and ``shape`` (the file
    still decides): asked before any file is opened."""
    kind = _RAW_KINDS.get(dtype)
    return kind is not None and math.prod(shape) * kind[2] <= RAW_MAX_BYTES


def inspect_pt(path: str | os.PathLike, *, max_members: int = 64,
               max_uncompressed: int = 8 << 30) -> PtInfo:
    """Parse the archive and data.pkl; check the view fits the storage. Reads no tensor data."""
    path = os.fspath(path)
    got = _fast(path, max_members, max_uncompressed, False)
    return got[0] if got is not None else _inspect_zipfile(path, max_members, max_uncompressed)


def open_pt(path: str | os.PathLike, limit: int = 8 << 30) -> np.ndarray:
    """``load_pt(inspect_pt(path))`` with one open of the file where it has the plain layout."""
    path = os.fspath(path)
    got = _fast(path, 64, 8 << 30, True)
    if got is not None and got[1] is not None:
        return got[1]
    return load_pt(got[0] if got is not None else inspect_pt(path), limit)


def open_pt_raw(path: str | os.PathLike) -> RawTensor | None:
    """A float32, float16 or bfloat16 tensor of the plain layout, contiguous, little-endian and
    not larger than the compare takes whole, as a flat buffer of its mapped words (no numpy);
    None for any other tensor, a file that is not the plain layout or one it refuses:
    :func:`open_pt` reads those, or says why not."""
    got = _fast(os.fspath(path), 64, 8 << 30, "raw")
    return got[1] if got is not None else None


def _fast(path: str, max_members: int, max_uncompressed: int,
          load: bool | str) -> tuple[PtInfo, np.ndarray | RawTensor | None] | None:
    """The plain layout (storedzip.py) read through one descriptor: the description and, with
    ``load``, the tensor mapped from the same descriptor (``load="raw"``: as a RawTensor where
    :func:`open_pt_raw` takes it). None: take zipfile's path."""
    try:   # open_regular's checks, less the two fcntl calls that clear O_NONBLOCK: pread and mmap
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)   # ignore it on a regular file
    except OSError:
        return None   # the zipfile path opens it again and says why
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None   # (zipfile's path refuses it, naming what it is)
        z = read_stored_zip(fd, max_members=max_members, max_uncompressed=max_uncompressed, size=st.st_size)
        if z is None:
            return None
        pkls = [n for n in z.members if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1 or z.members[pkls[0]].size > MAX_PICKLE:
            return None
        prefix = pkls[0][: -len("data.pkl")]
        pkl = z.member(z.members[pkls[0]])
        if pkl is None:
            return None
        ref = unpickle_tensor(pkl, f"{path}:{pkls[0]}")
        order = z.members.get(prefix + "byteorder")
        if order is not None and order.size > 16:
            return None
        raw_order = z.member(order) if order is not None else b""
        stored = z.members.get(f"{prefix}data/{ref.storage.key}")
        if raw_order is None or stored is None:
            return None
        data_offset = z.data_offset(stored)
        if data_offset is None:
            return None
        info = _checked(path, ref, raw_order.strip() == b"big", stored, data_offset)
        if load == "raw":
            return info, _raw(fd, info)
        if not load or info.itemsize * ref.storage.numel > _MAP_HERE or not all(ref.size):
            return info, None   # large tensors: np.memmap, whose pages a compare can drop behind it
        start = data_offset - data_offset % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(fd, data_offset - start + info.itemsize * ref.storage.numel,
                       access=mmap.ACCESS_READ, offset=start)
        flat = np.frombuffer(mm, dtype=info.np_dtype, count=ref.storage.numel, offset=data_offset - start)
        return info, _view(info, flat)
    except Exception:  # noqa: BLE001 - every problem is zipfile's path's to report, in its words
        return None
    finally:
        os.close(fd)


def _raw(fd: int, info: PtInfo) -> RawTensor | None:
    """The tensor's words mapped from ``fd`` as a flat memoryview, or None (see open_pt_raw)."""
    kind = _RAW_KINDS.get(info.dtype)
    ref = info.ref
    count = math.prod(ref.size)
    nbytes = count * info.itemsize
    if kind is None or info.code.startswith(">") or sys.byteorder != "little" or not count \
            or not _contiguous(ref) or nbytes > RAW_MAX_BYTES or info.data_offset is None:
        return None
    first = info.data_offset + ref.offset * info.itemsize
    start = first - first % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, first - start + nbytes, access=mmap.ACCESS_READ, offset=start)
    words = memoryview(mm)[first - start:].cast(kind[1])
    return RawTensor(words, kind[0], ref.size)


def _inspect_zipfile(path: str, max_members: int, max_uncompressed: int) -> PtInfo:
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
    return _checked(path, ref, big, member, data_offset)


def _checked(path: str, ref: TensorRef, big: bool, member: zipfile.ZipInfo | Member, data_offset: int | None) -> PtInfo:
    code, name = STORAGE_DTYPES[ref.storage.stype]
    if big and code.startswith("<"):
        code = ">" + code[1:]
    itemsize = _ITEMSIZE[code.lstrip("<>|")]
    numel = ref.storage.numel
    if numel * itemsize > member.file_size:
        raise DumpError(f"{path}: storage declares {numel} elements, member has {member.file_size} bytes")
    if member.file_size > numel * itemsize + SLACK:  # checked before anything is inflated
        raise DumpError(f"{path}: storage member declares {member.file_size} bytes, its {numel} elements "
                        f"need only {numel * itemsize}; refused")
    if len(ref.size) > 64 or math.prod(ref.size) > MAX_ELEMENTS:
        raise DumpError(f"{path}: tensor of shape {ref.size} is too large"[:300])
    if all(ref.size):
        last = ref.offset + sum((d - 1) * s for d, s in zip(ref.size, ref.stride))
        if last >= numel:
            raise DumpError(f"{path}: tensor view reaches element {last} of a {numel}-element storage")
    return PtInfo(path, name, code, ref.size, ref, member, data_offset)


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
    return _view(info, flat)


def _view(info: PtInfo, flat: np.ndarray) -> np.ndarray:
    """The tensor's view of its storage ``flat``, read-only."""
    ref = info.ref
    itemsize = info.itemsize
    if _contiguous(ref):
        arr = flat[ref.offset: ref.offset + math.prod(ref.size)].reshape(ref.size)
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
    count, skip = math.prod(ref.size), ref.offset * info.itemsize
    if info.data_offset is not None:
        return FileRegion(info.path, info.data_offset + skip, info.np_dtype, count, ref.size)
    return ZipRegion(info.path, info.member.filename, skip, info.np_dtype, count, ref.size)


def read_pt(path: str | os.PathLike, *, name: str | None = None) -> DumpTensor:
    info = inspect_pt(path)
    stem = name if name is not None else os.path.basename(info.path).removesuffix(".pt")
    return DumpTensor(name=stem, io="", index=0, dtype=info.dtype, shape=info.shape, order=0,
                      path=info.path, load=lambda: load_pt(info), region=lambda: pt_region(info))
