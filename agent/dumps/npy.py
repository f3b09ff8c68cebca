"""Read numpy ``.npy`` / ``.npz`` tensor dumps without trusting them.

Headers are parsed eagerly (dtype, shape, size checked against the file); the data is only
touched when ``DumpTensor.load`` is called, and then as a read-only memory map where possible.
Object arrays are refused (they would need pickle). ``.npz`` archives are bounded against
decompression bombs: member count, declared sizes and compression ratio are checked before any
member is decompressed, and decompression never produces more than the declared size.

The zip helpers here are shared with :mod:`.torchzip`.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from typing import BinaryIO, Callable

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from ..safeio import open_regular_file
from .types import LIMITS, DumpError, DumpTensor, FileRegion, ZipRegion

MAX_HEADER = 64 * 1024          # numpy itself refuses headers over 10000 bytes by default
MAX_RATIO = 1100                # deflate cannot exceed ~1032:1; anything beyond is a lie
SLACK = 64 * 1024               # a member may declare this many bytes beyond what its tensor needs
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


# ----------------------------------------------------------------------------- npy headers

def parse_npy_header(fp: BinaryIO, what: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Return (dtype, shape, fortran_order, header_length) of the npy stream at ``fp``."""
    start = fp.tell()
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp, max_header_size=MAX_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp, max_header_size=MAX_HEADER)
        elif version == (3, 0) and hasattr(np.lib.format, "_read_array_header"):
            shape, fortran, dtype = np.lib.format._read_array_header(fp, version, max_header_size=MAX_HEADER)
        else:
            raise DumpError(f"{what}: unsupported npy format version {version}")
    except DumpError:
        raise
    except Exception as exc:  # ValueError, EOFError, SyntaxError from the header literal
        raise DumpError(f"{what}: bad npy header: {exc}") from None
    if dtype.hasobject:
        raise DumpError(f"{what}: npy holds Python objects (would need pickle); refused")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise DumpError(f"{what}: bad npy shape {shape!r}")
    return dtype, tuple(int(d) for d in shape), bool(fortran), fp.tell() - start


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def dtype_name(dtype: np.dtype) -> str:
    return dtype.name if dtype.names is None else str(dtype)


# ----------------------------------------------------------------------------- .npy

def read_npy(path: str | os.PathLike, *, name: str | None = None) -> DumpTensor:
    path = os.fspath(path)
    try:
        with open_regular_file(path) as fp:
            dtype, shape, fortran, hlen = parse_npy_header(fp, path)
            size = os.fstat(fp.fileno()).st_size
    except OSError as exc:
        raise DumpError(f"{path}: cannot read: {exc.strerror or exc}") from None
    count = _numel(shape)
    need = hlen + count * dtype.itemsize
    if size < need:
        raise DumpError(f"{path}: truncated npy: {size} bytes, header says {need}")
    order = "F" if fortran else "C"

    def load() -> np.ndarray:
        if count == 0:
            return np.empty(shape, dtype=dtype, order=order)
        try:
            with open_regular_file(path) as fh:
                return np.memmap(fh, dtype=dtype, mode="r", offset=hlen, shape=shape, order=order)
        except Exception as exc:
            raise DumpError(f"{path}: cannot load npy: {exc}") from None

    region = FileRegion(path, hlen, dtype, count, shape)
    stem = name if name is not None else os.path.basename(path).removesuffix(".npy")
    return DumpTensor(name=stem, io="", index=0, dtype=dtype_name(dtype), shape=shape, order=0,
                      path=path, load=load, region=lambda: region)


# ----------------------------------------------------------------------------- zip helpers

def open_zip(path: str, *, max_members: int, max_uncompressed: int) -> zipfile.ZipFile:
    """Open a zip and check its directory before anything is decompressed."""
    try:
        zf = _ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
        # NotImplementedError: a member needs a zip feature (version, compression) zipfile lacks
        raise DumpError(f"{path}: not a readable zip: {exc}") from None
    try:
        infos = zf.infolist()
        if len(infos) > max_members:
            raise DumpError(f"{path}: zip has {len(infos)} members (limit {max_members})")
        total = 0
        for info in infos:
            if not info.filename:  # zipfile's own ZipInfo.is_dir() fails on an empty name
                raise DumpError(f"{path}: zip member with an empty name")
            check_member(path, info)
            total += info.file_size
        if total > max_uncompressed:
            raise DumpError(f"{path}: zip declares {total} uncompressed bytes (limit {max_uncompressed})")
    except BaseException:
        zf.close()
        raise
    return zf


class _ZipFile(zipfile.ZipFile):
    """A zip opened through :func:`open_regular_file` (a FIFO never blocks), closing it with itself."""

    def __init__(self, path: str) -> None:
        self._own = None
        fh = open_regular_file(path)
        self._own = fh
        super().__init__(fh)

    def close(self) -> None:
        try:
            if hasattr(self, "filelist"):  # fully initialised
                super().close()
        finally:
            if self._own is not None:
                self._own.close()


def check_member(path: str, info: zipfile.ZipInfo) -> None:
    where = f"{path}:{info.filename}"
    if info.flag_bits & 0x1:
        raise DumpError(f"{where}: encrypted zip member")
    if info.compress_type == zipfile.ZIP_STORED:
        if info.compress_size != info.file_size:
            raise DumpError(f"{where}: stored member with compressed size {info.compress_size} "
                            f"!= size {info.file_size}")
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        if info.file_size > MAX_RATIO * max(info.compress_size, 1) + 1024:
            raise DumpError(f"{where}: compression ratio {info.file_size}/{info.compress_size} "
                            f"exceeds {MAX_RATIO} (zip bomb?)")
    else:
        raise DumpError(f"{where}: unsupported zip compression method {info.compress_type}")


def stored_data_offset(path: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> int:
    """File offset of a stored member's data, from its local header (not assumed fixed)."""
    fp = zf.fp
    assert fp is not None
    fp.seek(info.header_offset)
    raw = fp.read(_LOCAL_HEADER.size)
    if len(raw) != _LOCAL_HEADER.size or raw[:4] != b"PK\x03\x04":
        raise DumpError(f"{path}:{info.filename}: bad zip local header")
    fields = _LOCAL_HEADER.unpack(raw)
    off = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    fp.seek(0, io.SEEK_END)
    if off + info.file_size > fp.tell():
        raise DumpError(f"{path}:{info.filename}: member data runs past the end of the file")
    return off


def read_member(path: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes:
    """Read a whole member, never more than min(declared size, limit) bytes; the declared size
    is checked against ``limit`` before anything is inflated."""
    if info.file_size > limit:
        raise DumpError(f"{path}:{info.filename}: member inflates to {info.file_size} bytes, more than "
                        f"the {limit} that may be held in memory (limits.max_decompressed_bytes)")
    try:
        with zf.open(info) as fh:
            data = fh.read(info.file_size + 1)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise DumpError(f"{path}:{info.filename}: cannot read zip member: {exc}") from None
    except Exception as exc:  # zlib.error and friends
        raise DumpError(f"{path}:{info.filename}: corrupt zip member: {exc}") from None
    if len(data) != info.file_size:
        raise DumpError(f"{path}:{info.filename}: member is {len(data)} bytes, declared {info.file_size}")
    return data


def member_array(path: str, info: zipfile.ZipInfo, dtype: np.dtype, count: int, skip: int,
                 limit: int) -> np.ndarray:
    """``count`` elements of ``dtype`` from a member, ``skip`` bytes in: memory-mapped if stored,
    else decompressed (bounded by the declared size, ``limit`` and
    ``LIMITS.max_decompressed_bytes``, all checked before inflating)."""
    need = skip + count * dtype.itemsize
    if need > info.file_size:
        raise DumpError(f"{path}:{info.filename}: member holds {info.file_size} bytes, need {need}")
    if count == 0:
        return np.empty(0, dtype=dtype)
    try:
        with _ZipFile(path) as zf:
            if info.compress_type == zipfile.ZIP_STORED:
                off = stored_data_offset(path, zf, info)
                return np.memmap(zf._own, dtype=dtype, mode="r", offset=off + skip, shape=(count,))
            data = read_member(path, zf, info, min(limit, LIMITS.max_decompressed_bytes))
    except DumpError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError) as exc:
        raise DumpError(f"{path}:{info.filename}: cannot read: {exc}") from None
    return np.frombuffer(data, dtype=dtype, count=count, offset=skip)


# ----------------------------------------------------------------------------- .npz

def read_npz(path: str | os.PathLike, max_members: int = 4096,
             max_uncompressed: int = 8 << 30) -> list[DumpTensor]:
    path = os.fspath(path)
    out: list[DumpTensor] = []
    with open_zip(path, max_members=max_members, max_uncompressed=max_uncompressed) as zf:
        for order, info in enumerate(zf.infolist()):
            if info.is_dir():
                continue
            where = f"{path}:{info.filename}"
            try:
                with zf.open(info) as fh:
                    head = io.BytesIO(fh.read(min(info.file_size, MAX_HEADER + 16)))
            except Exception as exc:  # BadZipFile, zlib.error, EOFError, ...
                raise DumpError(f"{where}: cannot read zip member: {exc}") from None
            dtype, shape, fortran, hlen = parse_npy_header(head, where)
            count = _numel(shape)
            check_declared(where, info.file_size, hlen + count * dtype.itemsize)
            if info.compress_type == zipfile.ZIP_STORED:
                off = stored_data_offset(path, zf, info)
                region: FileRegion | ZipRegion = FileRegion(path, off + hlen, dtype, count, shape)
            else:
                region = ZipRegion(path, info.filename, hlen, dtype, count, shape)
            out.append(DumpTensor(name=info.filename.removesuffix(".npy"), io="", index=0,
                                  dtype=dtype_name(dtype), shape=shape, order=order, path=path,
                                  load=_npz_loader(path, info, dtype, shape, fortran, hlen,
                                                   max_uncompressed),
                                  extra={"member": info.filename}, region=_const(region)))
    return out


def _const(region: FileRegion | ZipRegion) -> Callable[[], FileRegion | ZipRegion]:
    return lambda: region


def check_declared(where: str, declared: int, need: int) -> None:
    """A member's declared (uncompressed) size against what its tensor's shape and dtype need,
    before anything is inflated: fewer bytes is a truncated member, many more a lie (a bomb)."""
    if declared < need:
        raise DumpError(f"{where}: truncated member: {declared} bytes, the tensor needs {need}")
    if declared > need + SLACK:
        raise DumpError(f"{where}: member declares {declared} bytes, its tensor needs only {need}; refused")


def _npz_loader(path: str, info: zipfile.ZipInfo, dtype: np.dtype, shape: tuple[int, ...],
                fortran: bool, hlen: int, limit: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        flat = member_array(path, info, dtype, _numel(shape), hlen, limit)
        return flat.reshape(shape, order="F" if fortran else "C")
    return load
