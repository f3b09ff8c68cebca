"""Which reader follows a file: TensorBoard event files (by name, ``events.out.tfevents.*``, or by
their content: a first record whose header CRC holds), CSV metric logs (``metrics.csv`` and other
``*.csv``), and text logs (everything else). The daemon and ``replay`` open every file here, so
both read each kind with the same code."""

from __future__ import annotations

import fnmatch
import os
from typing import Callable, Mapping

from ..safeio import open_regular
from .filecursor import MetricFileStream
from .logstream import LogStream
from .metriccsv import CsvStream
from .tailer import TailPosition
from .tfevents import TfEventsStream, is_event_file

EVENT_FILE_GLOB = "events.out.tfevents.*"
CSV_GLOB = "*.csv"
METRICS_CSV = "metrics.csv"  # Lightning's CSVLogger: a CSV metric log under any watch
STRUCTURED_FORMATS = {"tfevents": TfEventsStream, "csv": CsvStream}
TEXT_EXTENSIONS = {".log", ".txt", ".out", ".err", ".jsonl", ".json", ".stdout", ".stderr"}  # never sniffed


def _sniff_event_file(path: str) -> bool:
    try:
        fd = open_regular(path)
    except OSError:
        return False
    try:
        return is_event_file(os.pread(fd, 12, 0))
    except OSError:
        return False
    finally:
        os.close(fd)


def file_kind(path: str, fmt: str = "auto") -> str:
    """``tfevents``, ``csv`` or ``text``: the watch's ``format`` when it names a structured one,
    else the file's name, else its first bytes (an event file under another name). A watch that
    pins a text format (``hf_trainer``, ``custom``, ...) pins it for its text logs only: its
    ``events.out.tfevents.*``, ``metrics.csv`` and sniffed event files still go to their readers
    (the default ``include`` picks them up beside the logs; a text parser reads binary records as
    noise); another ``*.csv`` is text there."""
    if fmt in STRUCTURED_FORMATS:
        return fmt
    name = os.path.basename(path)
    if fnmatch.fnmatch(name, EVENT_FILE_GLOB):
        return "tfevents"
    if name.lower() == METRICS_CSV or (fmt == "auto" and fnmatch.fnmatch(name.lower(), CSV_GLOB)):
        return "csv"
    if os.path.splitext(name)[1].lower() in TEXT_EXTENSIONS | {".csv"}:
        return "text"  # (no open per text log at start-up, where thousands may wait)
    # a text log never starts with 8 bytes whose masked CRC-32C follows them (nor holds NULs there)
    return "tfevents" if _sniff_event_file(path) else "text"


def open_stream(path: str, labels: Mapping[str, str] | None = None, fmt: str = "auto",
                position: TailPosition | None = None, *, start_at_end: bool = False,
                max_line_bytes: int = 1 << 20, chunk_bytes: int = 1 << 20, pattern: str | None = None,
                check_open: Callable[[str, int], None] | None = None) -> LogStream | MetricFileStream:
    """The stream that reads ``path``: a structured reader or a text ``LogStream`` (which raises
    ``UnknownFormat`` for a bad ``fmt``). ``start_at_end`` (no saved ``position``) skips what the
    file already holds, for every kind: up to its last whole record (a CSV's header is kept)."""
    kind = file_kind(path, fmt)
    if kind in STRUCTURED_FORMATS:
        return STRUCTURED_FORMATS[kind](path, labels, position, check_open=check_open,
                                        max_record_bytes=max_line_bytes, start_at_end=start_at_end)
    return LogStream(path, labels, fmt, position, start_at_end=start_at_end, max_line_bytes=max_line_bytes,
                     chunk_bytes=chunk_bytes, pattern=pattern, check_open=check_open)
