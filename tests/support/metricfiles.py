"""The structured metric-file fixtures (tests/fixtures/metricfiles, written by the real writers: see
make.py there) and helpers that take them apart as a writer would write them: record by record
(TFRecord framing, split here independently of the agent's reader) or row by row."""

from __future__ import annotations

import glob
import struct
from pathlib import Path

from conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "metricfiles"
HF_NAN_STEP, MEGATRON_INF_STEP, LIGHTNING_NAN_STEP, STEPS = 37, 40, 25, 60


def event_file(case: str) -> Path:
    """The (single) event file of a fixture run, e.g. ``hf_ok``."""
    (path,) = glob.glob(str(FIXTURES / case / "**" / "events.out.tfevents.*"), recursive=True)
    return Path(path)


def csv_file(case: str) -> Path:
    return FIXTURES / case / "lightning_logs" / "version_0" / "metrics.csv"


def records(path: Path) -> list[bytes]:
    """The framed records of an event file, each as written (header, data, footer)."""
    data = path.read_bytes()
    out, at = [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        out.append(data[at:at + 16 + length])
        at += 16 + length
    assert b"".join(out) == data
    return out


def before_rewrite(case: str) -> tuple[bytes, bytes]:
    """A CSVLogger file as the logger wrote it just before a new column made it rewrite the file
    (make.py copied it then), and the final file."""
    return (FIXTURES / case / "metrics_before_rewrite.csv").read_bytes(), csv_file(case).read_bytes()


APPENDER = r"""
import sys
src, dest, spans = sys.argv[1], sys.argv[2], sys.argv[3:]
data = open(src, "rb").read()
with open(dest, "ab") as f:
    for span in spans:  # each "start:end" of src written and flushed on its own: record by record
        a, b = map(int, span.split(":"))
        f.write(data[a:b])
        f.flush()
"""


def append_spans(src: Path, dest: Path, spans: list[tuple[int, int]]) -> None:
    """Append byte spans of ``src`` to ``dest`` from another process, one write per span."""
    import subprocess
    import sys
    subprocess.run([sys.executable, "-c", APPENDER, str(src), str(dest), *(f"{a}:{b}" for a, b in spans)],
                   check=True, timeout=60)


def record_spans(path: Path) -> list[tuple[int, int]]:
    """(start, end) of each record of an event file."""
    out, at = [], 0
    for r in records(path):
        out.append((at, at + len(r)))
        at += len(r)
    return out
