"""What a tailer hands out (readers/tailer.py): blocks of lines, positions to persist, events."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TailPosition:
    """Checkpoint to persist after the returned blocks were processed."""

    dev: int  # st_dev of the file generation being read
    ino: int  # st_ino of that generation
    offset: int  # byte offset just after the last complete line consumed
    line: int  # complete lines consumed in this generation (next line = line + 1)


@dataclass(frozen=True, slots=True)
class TextBlock:
    """Consecutive complete lines from one file generation."""

    path: str  # the watched path, even when the bytes came from a rotated generation
    text: str  # decoded lines, each ending with "\n"
    first_line: int  # 1-based number of the first line within its generation
    n_lines: int
    start_offset: int
    end_offset: int  # byte offset after the last line of the block
    generation: tuple[int, int]  # (dev, ino) the bytes came from
    truncated_lines: int = 0  # lines cut at max_line_bytes in this block


class TailEvent(enum.Enum):
    """Notable things that happened to the followed file (see drain_events)."""

    ROTATED = "rotated"  # the path now names another file; switched to it
    TRUNCATED = "truncated"  # same file shrank below our position; restarted at 0
    RESUMED_FROM_ROTATED = "resumed_from_rotated"  # saved generation found renamed
    MISSING = "missing"  # the path does not exist (reported once per absence)
    ERROR = "error"  # an OSError (e.g. permission denied); read() returned what it had
