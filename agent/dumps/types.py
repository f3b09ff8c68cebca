"""What every dump reader yields: one tensor's identity, in execution order, with a way to get
its data without loading more than needed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

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


class DumpError(Exception):
    """A dump file that cannot be read (corrupt, truncated, hostile): the message says why."""
