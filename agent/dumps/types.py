"""What every dump reader yields: one tensor's identity, in execution order, with a way to get
its data without loading more than needed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from ..model import TensorStats


@dataclass(slots=True)
class DumpTensor:
    name: str                 # op or module name (the key used to pair with a benchmark)
    io: str                   # "input" | "output" | "param"
    index: int                # input/output slot
    dtype: str                # numpy-style name, or "bfloat16" (data then comes as raw uint16 words)
    shape: tuple[int, ...]
    order: int                # execution order within its step/rank (0-based)
    step: int | None = None
    rank: int | None = None
    path: str = ""
    op_type: str = ""
    # the data: a callable returning an array (often a memmap or a view into one). None when the
    # dump holds statistics only (msprobe statistics mode, MindSpore statistic.csv)
    load: Callable[[], np.ndarray] | None = None
    stats: TensorStats | None = None   # statistics given by the dump itself, if any
    extra: dict = field(default_factory=dict)
    # where the same data lies in a file, for the scanner's bounded windows (agent/dumps/windows.py):
    # a plain stretch of a file, or a deflated zip member streamed in bounded chunks. None: the
    # scanner uses ``load`` (strided views, statistics-only dumps)
    region: "Callable[[], FileRegion | ZipRegion | None] | None" = None
    # the data as flat native words for the compare's C kernel, without numpy (RawTensor), read as
    # ``load``'s array is (bfloat16 where ``dtype`` says so); None where it has no such form
    # (another dtype, a strided view, big-endian, too large): ``load`` then
    raw: "Callable[[], RawTensor | None] | None" = None


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A tensor's elements in C order as one flat buffer of native words, read without numpy
    (compare/engine.py gives it to the C kernel whole: compare/metrics.compare_raw, kernels/compare_raw.py)."""

    words: memoryview          # 1-D; format "f" for float32, "H" for float16 and bfloat16 words
    code: str                  # "f4" | "f2" | "bf16"
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FileRegion:
    """``count`` elements of ``dtype``, contiguous in file order, from byte ``offset`` of ``path``."""

    path: str
    offset: int
    dtype: np.dtype
    count: int
    shape: tuple[int, ...]     # reported in the statistics (what ``load`` would return)


@dataclass(frozen=True, slots=True)
class ZipRegion:
    """``count`` elements of ``dtype`` from ``skip`` bytes into deflated member ``member`` of the
    zip ``path``, inflated as a stream (never more than a window at once)."""

    path: str
    member: str
    skip: int
    dtype: np.dtype
    count: int
    shape: tuple[int, ...]


class DumpError(Exception):
    """A dump file that cannot be read (corrupt, truncated, hostile): the message says why."""


@dataclass(slots=True)
class DumpLimits:
    """Process-wide bounds of the dump readers; the daemon sets them from ``config.limits``."""

    # a deflated member (.npz, torch.save) is inflated into memory (compare, watchpoints) only up to
    # this size; the scanner streams any size through a bounded buffer instead
    max_decompressed_bytes: int = 128 << 20


LIMITS = DumpLimits()
