"""CSV metric logs, as Lightning's ``CSVLogger`` writes them (``metrics.csv``): a header row, a
``step`` column, one row per logging call with empty cells for what was not logged then, ``nan``
for a NaN. Columns are mapped to the agent's metrics by the metric map.

Lightning rewrites the whole file, with a new header, when a new column appears (``open("w")``:
same inode; it truncates, then writes every row again and appends the new ones). That is not a new
run and nothing is read twice: the reader counts the rows it has read, and when the header changes
(or the file is shorter than its offset) it finds the same number of rows in the rewritten file
and goes on after them. While the rewrite is still being written (fewer rows than read so far,
and the new header keeps every old column) it waits. A file whose new header drops columns is
another run's file under the same name: read from its start.

Traps handled here: ``\\r\\n`` line ends (the csv module's), a torn last line (waited for; read at
the end of a finished file in ``replay``), NULs, odd quoting (a damaged row is counted and
skipped), rows and headers over the record limit (skipped without being held).
"""

from __future__ import annotations

import csv
import time as _time

from ..model import Sample
from .filecursor import UNMAPPED_KEPT, MetricFileStream
from .metricmap import current_map
from .parsers.base import to_float, to_step
from .tailer import TailEvent

CHUNK = 1 << 20


def _cells(line: bytes) -> list[str] | None:
    text = line.replace(b"\0", b"").decode("utf-8", "replace").rstrip("\r\n")
    try:
        rows = list(csv.reader([text], strict=True))
    except csv.Error:
        return None
    return rows[0] if len(rows) == 1 else None


class CsvStream(MetricFileStream):
    FORMAT = "csv"
    NAMES = "columns"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header: bytes | None = None          # the header line as read (its bytes)
        self._columns: list[str] = []
        self._map: list[tuple[int, str]] = []      # (column index, metric)
        self._step_col: int | None = None
        self._checked = False                      # a saved offset was checked against the file
        self._long: tuple[int, int] | None = None  # a row over the limit: (its start, searched up to)

    def _read(self, budget: int, now: float | None, final: bool) -> list[Sample]:
        cur = self.tailer
        size = cur.size(restart_on_shrink=False)
        held = self.existing(size)
        if size is None:
            return []
        known = self._header
        head = cur.pread(len(known), 0) if known else b""
        if not known or head != known:  # (the same first bytes, newline included: the same header)
            head = cur.pread(min(size, self.max_record + 2), 0)
        nl = head.find(b"\n")
        if nl < 0:
            if size > self.max_record:
                self.skipped("header", f"header line over the limit ({self.max_record} bytes); file not read")
            return []  # the header is being written
        header = head[:nl + 1]
        if not self._settle(header, size):
            return []
        if held is not None:
            self._skip_existing(min(held, size))
        t = _time.time() if now is None else now
        out: list[Sample] = []
        start = cur.offset
        looked = cur.offset  # how far the bytes were looked at (the cursor's ``seen``)
        while budget > 0 and cur.offset < size:
            if self._long is None or self._long[0] != cur.offset:
                data = cur.pread(min(budget, CHUNK, size - cur.offset), cur.offset)
                last = data.rfind(b"\n")
                if last >= 0:
                    self._rows(data[:last + 1], t, out)
                    cur.offset += last + 1
                    budget -= last + 1
                    continue
            # the row is longer than this read, over the limit, or torn (being written)
            used, looked = self._one_row(size, budget, final, t, out)
            if not used:
                break
            budget -= used
        cur.seen = max(cur.offset, looked)
        self.stats.bytes += max(cur.offset - start, 0)
        if cur.offset == size and cur.replaced():
            self._header = None
            return out + self._read(budget, now, final)
        return out

    def _one_row(self, size: int, budget: int, final: bool, t: float, out: list[Sample]) -> tuple[int, int]:
        """The row at the offset, when no read so far held its end: read whole within the limit
        (at most ``max_record`` + 1 bytes are held), else skipped unread; a torn last row waits.
        The bytes consumed (0: nothing yet) and how far the file was looked at."""
        cur = self.tailer
        at = cur.offset
        if self._long is None or self._long[0] != at:
            row = cur.pread(min(self.max_record + 1, size - at), at)
            nl = row.find(b"\n")
            if nl >= 0:
                self._rows(row[:nl + 1], t, out)
                cur.offset = at + nl + 1
                return nl + 1, cur.offset
            if len(row) <= self.max_record:
                if final and at + len(row) == size:
                    self._rows(row + b"\n", t, out)
                    cur.offset = size
                    return len(row), size
                return 0, at + len(row)  # a torn last row: wait for its end
            self._long = (at, at + len(row))
        # over the limit: find its end from where the last search stopped (each byte looked at once)
        end = self._long[1]
        while end < size and end - self._long[1] < budget:
            data = cur.pread(min(CHUNK, size - end), end)
            if not data:
                break
            nl = data.find(b"\n")
            if nl >= 0:
                return self._skip_long(end + nl + 1), end + nl + 1
            end += len(data)
        self._long = (at, end)
        if final and end >= size:
            return self._skip_long(size), size
        return 0, end

    def _skip_long(self, end: int) -> int:
        """Skip the row over the limit that ends at ``end`` (its newline included)."""
        cur = self.tailer
        self.skipped("oversized", f"row at byte {cur.offset} is over the limit ({self.max_record} bytes); "
                     "skipped unread")
        self.stats.lines += 1
        used, self._long = end - cur.offset, None
        cur.offset, cur.line = end, cur.line + 1
        return used

    def _settle(self, header: bytes, size: int) -> bool:
        """Place the offset after the rows already read, whatever happened to the file since;
        False while there is nothing to read yet."""
        cur = self.tailer
        if self._header is None and cur.offset == 0:
            self._adopt(header)
            cur.offset, cur.line = len(header), 1
            return True
        if self._header is None:  # a saved position: is it still where the rows it counted end?
            self._adopt(header)
            if cur.offset <= size and self._lines_before(cur.offset) == cur.line:
                return True
            self._header = b""  # rewritten while the agent was away: find the rows again
        if header == self._header and size >= cur.offset:
            return True
        old = set(self._columns)
        self._adopt(header)
        rows_done = cur.line - 1
        at, found = len(header), 0
        while found < rows_done and at < size:
            data = cur.pread(min(CHUNK, size - at), at)
            if not data:
                return False  # (an I/O error, said by the cursor)
            n = data.count(b"\n")
            if found + n < rows_done:
                found, at = found + n, at + len(data)
                continue
            idx = -1
            for _ in range(rows_done - found):
                idx = data.find(b"\n", idx + 1)
            found, at = rows_done, at + idx + 1
        if found == rows_done:
            cur.offset = at
            return True
        if old <= set(self._columns):
            self._header = b""  # search again at the next poll, whatever the header is then
            return False  # the rewrite is still being written: wait for the rows already read
        cur.restart("rewritten with other columns and fewer rows: another run's file; reading from its start",
                    TailEvent.TRUNCATED)
        cur.offset, cur.line = len(header), 1
        return True

    def _skip_existing(self, size: int) -> None:
        """``start_at_end``: go on after the file's last whole row (the header is kept, the rows
        before are counted, as if read)."""
        cur, end = self.tailer, size
        while end > cur.offset:
            at = max(end - CHUNK, cur.offset)
            data = cur.pread(end - at, at)
            if len(data) < end - at:
                return  # (an I/O error, said by the cursor: try again at the next read)
            nl = data.rfind(b"\n")
            if nl >= 0:
                lines = self._lines_before(at + nl + 1)
                if lines < 0:
                    return
                cur.offset, cur.line = at + nl + 1, lines
                break
            end = at
        self.at_end = False

    def _adopt(self, header: bytes) -> None:
        self._header, self._long = header, None
        mmap, _ = current_map()
        self._columns = [c.strip() for c in (_cells(header) or [])]
        self._map = [(i, m) for i, c in enumerate(self._columns) if (m := mmap.metric(c)) is not None]
        mapped = {i for i, _ in self._map}
        self.mapped_names = [self._columns[i][:64] for i in sorted(mapped)][:UNMAPPED_KEPT]
        self.unmapped = dict.fromkeys(c[:64] for i, c in enumerate(self._columns[:UNMAPPED_KEPT]) if i not in mapped)
        lowered = [c.lower() for c in self._columns]
        self._step_col = next((lowered.index(c) for c in mmap.step_columns if c in lowered), None)

    def _lines_before(self, end: int) -> int:
        """Newlines in the file's first ``end`` bytes, and whether ``end`` is a line start (else -1)."""
        cur, at, n = self.tailer, 0, 0
        if end > 0 and cur.pread(1, end - 1) != b"\n":
            return -1
        while at < end:
            data = cur.pread(min(CHUNK, end - at), at)
            if not data:
                return -1
            n += data.count(b"\n")
            at += len(data)
        return n

    def _rows(self, data: bytes, t: float, out: list[Sample]) -> None:
        cur = self.tailer
        offset = cur.offset
        for line in data[:-1].split(b"\n"):  # ``data`` ends with a newline
            cur.line += 1
            here, offset = offset, offset + len(line) + 1
            if not line.strip():
                continue
            self.stats.lines += 1
            cells = _cells(line) if len(line) <= self.max_record else None
            if cells is None:
                self.skipped("row", f"row at byte {here} is not a CSV row (quoting, size); skipped")
                continue
            step = None
            if self._step_col is not None and self._step_col < len(cells):
                step = to_step(to_float(cells[self._step_col]) if cells[self._step_col].strip() else None)
            values = [(m, v) for i, m in self._map if i < len(cells) and cells[i].strip()
                      and (v := to_float(cells[i].strip())) is not None]
            if values:
                self.stats.records += 1
                for metric, value in values:
                    out.append(self.sample(metric, value, step, cur.line, here, t, None))
