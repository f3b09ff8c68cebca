"""Tests for precision_agent.readers.tailer: real files, real rotation, a real writer process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_agent.readers.tailer import LogTailer, TailEvent, TailPosition, TextBlock


def append(path: Path, data: bytes | str) -> None:
    with open(path, "ab") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def lines(blocks: list[TextBlock]) -> list[tuple[int, str]]:
    """(line number, text) of every line, checking each block's own invariants."""
    out: list[tuple[int, str]] = []
    for b in blocks:
        parts = b.text.split("\n")  # NOT splitlines(): "\r" etc. are not separators
        assert parts[-1] == "" and len(parts) - 1 == b.n_lines >= 1
        assert b.end_offset > b.start_offset or b.text == "\n"
        out += [(b.first_line + i, s) for i, s in enumerate(parts[:-1])]
    return out


def drain(t: LogTailer, budget: int = 8 << 20) -> list[TextBlock]:
    out: list[TextBlock] = []
    while blocks := t.read(budget):
        out += blocks
    return out


def kinds(t: LogTailer) -> list[TailEvent]:
    return [k for k, _ in t.drain_events()]


@pytest.fixture
def log(tmp_path: Path) -> Path:
    p = tmp_path / "train.log"
    p.write_bytes(b"")
    return p


# ------------------------------------------------------------------ line framing
def test_partial_lines_split_mid_line_and_mid_utf8(log: Path) -> None:
    t = LogTailer(str(log))
    append(log, b"step 1 loss=0.5\nstep 2 l")
    assert lines(t.read()) == [(1, "step 1 loss=0.5")]
    st_ = log.stat()
    assert t.position == TailPosition(st_.st_dev, st_.st_ino, 16, 1)  # partial not consumed
    e = "é".encode()
    append(log, b"oss=" + e[:1])  # stop in the middle of a 2-byte character
    assert t.read() == []
    assert (t.position.offset, t.position.line) == (16, 1)  # partial line not consumed
    append(log, e[1:] + b"\nstep 3\n")
    assert lines(t.read()) == [(2, "step 2 loss=é"), (3, "step 3")]
    assert t.position.offset == log.stat().st_size and t.read() == []
    t.close()


def test_normalisation_crlf_cr_nul_invalid_utf8(log: Path) -> None:
    append(log, b"a\r\nb\rc\n\x00d\x00e\n\xff\xfeok\n\xe2\x82\nx\r\r\n\r\n")
    t = LogTailer(str(log))
    assert [s for _, s in lines(drain(t))] == [
        "a",  # CRLF -> LF
        "b\rc",  # lone CR is a character (tqdm frames), not a separator
        "de",  # NULs dropped
        "\ufffd\ufffdok",  # invalid UTF-8 replaced, never raises
        b"\xe2\x82".decode("utf-8", "replace"),
        "x\r",  # only one CR before LF is stripped
        "",
    ]
    t.close()


def test_tiny_chunks_keep_numbering_offsets_and_budget(log: Path) -> None:
    want = [f"line {i} " + "z" * (i % 13) for i in range(1, 201)]
    append(log, "".join(s + "\n" for s in want))
    t = LogTailer(str(log), chunk_bytes=7)
    got: list[TextBlock] = []
    while blocks := t.read(budget_bytes=50):
        before = got[-1].end_offset if got else 0
        assert t.position.offset - before <= 50 + 7 + 20  # bounded per call
        got += blocks
    assert len(got) > 100  # many chunks really happened
    assert lines(got) == list(enumerate(want, 1))
    for a, b in zip(got, got[1:]):
        assert b.start_offset == a.end_offset and b.first_line == a.first_line + a.n_lines
    assert t.position.offset == log.stat().st_size and t.position.line == 200
    t.close()


def test_flush_partial_consumes_last_unterminated_line(log: Path) -> None:
    append(log, b"a\nlast\r")
    t = LogTailer(str(log))
    assert lines(drain(t)) == [(1, "a")]
    b = t.flush_partial()
    assert b is not None and lines([b]) == [(2, "last")]
    assert b.end_offset == t.position.offset == log.stat().st_size
    assert t.flush_partial() is None and t.read() == []
    append(log, b"b\nc")  # bytes not read yet: flush reads on, a completed line comes first
    assert lines([t.flush_partial()]) == [(3, "b")]  # type: ignore[list-item]
    assert lines([t.flush_partial()]) == [(4, "c")]  # type: ignore[list-item]
    t.close()


def test_start_at_end_skips_history_and_keeps_true_line_numbers(log: Path) -> None:
    append(log, b"old 1\nold 2\npar")
    t = LogTailer(str(log), start_at_end=True, chunk_bytes=4)
    assert (t.position.offset, t.position.line) == (12, 2)
    append(log, b"tial\nnew\n")
    assert lines(drain(t)) == [(3, "partial"), (4, "new")]
    t.close()


# --------------------------------------------------------------------- rotation
@pytest.mark.parametrize("read_between", [False, True])
def test_rename_rotation_drains_old_generation_first(log: Path, read_between: bool) -> None:
    append(log, b"o1\no2\n")
    t = LogTailer(str(log))
    assert lines(drain(t)) == [(1, "o1"), (2, "o2")]
    old_gen = (log.stat().st_dev, log.stat().st_ino)
    append(log, b"o3\no4\no5 par")  # unread, ends with a partial line
    os.rename(log, str(log) + ".1")
    log.write_bytes(b"")  # logrotate `create`: the writer has not reopened yet
    if read_between:
        assert lines(drain(t)) == [(3, "o3"), (4, "o4")]
        append(Path(str(log) + ".1"), b"tial\n")  # the writer still appends to the old inode
        assert lines(drain(t)) == [(5, "o5 partial")]
        append(Path(str(log) + ".1"), b"o6 unterminated")
        assert TailEvent.ROTATED not in kinds(t)
    else:
        append(Path(str(log) + ".1"), b"tial\no6 unterminated")
    append(log, b"n1\nn2\n")  # the writer moved on: the old partial line is complete
    blocks = drain(t)
    got = lines(blocks)
    assert got[-3:] == [(6, "o6 unterminated"), (1, "n1"), (2, "n2")]
    if not read_between:
        assert got[:3] == [(3, "o3"), (4, "o4"), (5, "o5 partial")]
    assert {b.generation for b in blocks if b.first_line > 2} == {old_gen}
    assert blocks[-1].generation == (log.stat().st_dev, log.stat().st_ino) != old_gen
    assert all(b.path == str(log) for b in blocks)
    assert kinds(t) == [TailEvent.ROTATED]
    append(log, b"n3\n")
    assert lines(t.read()) == [(3, "n3")]
    t.close()


def test_copytruncate_restarts_at_zero(log: Path) -> None:
    append(log, b"a\nb\nc\n")
    t = LogTailer(str(log))
    assert len(lines(drain(t))) == 3
    shutil.copy(log, str(log) + ".1")
    with open(log, "r+b") as f:
        f.truncate(0)
    append(log, b"x\n")
    assert lines(drain(t)) == [(1, "x")]
    assert kinds(t) == [TailEvent.TRUNCATED]
    t.close()


def test_missing_path_keeps_draining_unlinked_file_then_follows_new(log: Path) -> None:
    writer = open(log, "ab", buffering=0)
    writer.write(b"a\n")
    t = LogTailer(str(log))
    assert lines(t.read()) == [(1, "a")]
    os.unlink(log)
    writer.write(b"b\n")  # still written through the open handle
    assert lines(t.read()) == [(2, "b")]
    assert t.read() == []
    assert kinds(t) == [TailEvent.MISSING]  # once, not on every poll
    writer.write(b"c")
    writer.close()
    log.write_bytes(b"new\n")
    assert lines(drain(t)) == [(3, "c"), (1, "new")]
    assert kinds(t) == [TailEvent.ROTATED]
    t.close()


def test_path_missing_at_start(tmp_path: Path) -> None:
    p = tmp_path / "later.log"
    t = LogTailer(str(p), start_at_end=True)
    assert t.position is None and t.read() == []
    assert kinds(t) == [TailEvent.MISSING]
    p.write_bytes(b"first\n")  # a file that appears later is read from its start
    assert lines(t.read()) == [(1, "first")]
    t.close()


# ------------------------------------------------------------------ restart resume
def test_resume_same_file_exactly_once(log: Path) -> None:
    append(log, "".join(f"l{i}\n" for i in range(1, 11)) + "l1")
    t = LogTailer(str(log), chunk_bytes=5)
    first = lines(t.read(budget_bytes=17))  # read only part of it
    assert first and first == [(i, f"l{i}") for i in range(1, len(first) + 1)]
    pos = t.position
    t.close()
    append(log, b"1\nl12\n")
    t2 = LogTailer(str(log), pos)
    rest = lines(drain(t2))
    assert first + rest == [(i, f"l{i}") for i in range(1, 13)]
    assert kinds(t2) == []
    t2.close()


def test_resume_after_rotation_while_down(log: Path) -> None:
    append(log, b"a1\na2\n")
    t = LogTailer(str(log))
    assert len(lines(drain(t))) == 2
    pos = t.position
    t.close()
    # --- agent down: more lines, then rename rotation, then the new file ---
    append(log, b"a3\na4 no newline")
    os.rename(log, log.with_name("train.log.1"))
    (log.parent / "unrelated.log").write_bytes(b"noise\n")
    log.write_bytes(b"b1\n")
    t2 = LogTailer(str(log), pos)
    assert kinds(t2) == [TailEvent.RESUMED_FROM_ROTATED]
    blocks = drain(t2)
    assert lines(blocks) == [(3, "a3"), (4, "a4 no newline"), (1, "b1")]
    assert blocks[0].generation == (pos.dev, pos.ino)
    assert kinds(t2) == [TailEvent.ROTATED]
    t2.close()


def test_resume_rotated_copy_gone_or_truncated(log: Path) -> None:
    append(log, b"a1\na2\n")
    t = LogTailer(str(log))
    drain(t)
    pos = t.position
    t.close()
    with open(log, "r+b") as f:  # same inode, shorter than the saved offset
        f.truncate(1)
    t2 = LogTailer(str(log), pos)
    append(log, b"\n")
    assert lines(drain(t2)) == [(1, "a")] and kinds(t2) == [TailEvent.TRUNCATED]
    t2.close()
    (log.parent / "archive").mkdir()  # rotated copy moved out of the directory while down
    os.rename(log, log.parent / "archive" / "train.log.1")
    log.write_bytes(b"z\n")
    t3 = LogTailer(str(log), pos)
    assert lines(drain(t3)) == [(1, "z")] and kinds(t3) == [TailEvent.ROTATED]
    t3.close()


def test_close_then_read_resumes_from_position(log: Path) -> None:
    append(log, b"a\nb")
    t = LogTailer(str(log))
    assert lines(t.read()) == [(1, "a")]
    t.close()
    append(log, b"\n")
    assert lines(t.read()) == [(2, "b")]
    t.close()


# ------------------------------------------------------------------- huge lines
def test_huge_line_in_pieces_is_truncated_with_bounded_memory(log: Path) -> None:
    max_line, chunk = 64 << 10, 16 << 10
    t = LogTailer(str(log), max_line_bytes=max_line, chunk_bytes=chunk)
    append(log, b"before\n")
    assert lines(t.read()) == [(1, "before")]
    piece = b"x" * (300 << 10)
    for _ in range(10):  # a 3 MB line arriving over many reads
        append(log, piece)
        assert t.read(budget_bytes=1 << 20) == []
        assert t.buffered_bytes <= max_line + chunk
        assert (t.position.offset, t.position.line) == (7, 1)  # still at the line start
    pos_mid = t.position
    append(log, b"y\r\nafter\n")
    blocks = drain(t, budget=200 << 10)
    assert t.buffered_bytes <= max_line + chunk
    assert lines(blocks) == [(2, "x" * max_line), (3, "after")]
    assert sum(b.truncated_lines for b in blocks) == 1
    assert t.position.offset == log.stat().st_size
    # a restart in the middle of the huge line delivers it exactly once
    t2 = LogTailer(str(log), pos_mid, max_line_bytes=max_line, chunk_bytes=chunk)
    assert lines(drain(t2)) == [(2, "x" * max_line), (3, "after")]
    t.close()
    t2.close()


def test_closing_inside_a_huge_line_resumes_the_skip_instead_of_rereading(log: Path) -> None:
    """The daemon closes descriptors beyond max_open_files between passes: a line of many budgets
    must still cost its bytes once (else a file reopened every pass would never get past it)."""
    max_line, chunk, budget = 4 << 10, 4 << 10, 64 << 10
    append(log, b"before\n" + b"z" * (1 << 20))
    t = LogTailer(str(log), max_line_bytes=max_line, chunk_bytes=chunk)
    assert lines(t.read(budget)) == [(1, "before")]
    passes = 1
    while t.unread_bytes() > 0:  # close after every pass, as under a tight max_open_files
        t.close()
        assert t.read(budget) == [] and t.buffered_bytes <= max_line
        passes += 1
        assert passes < 100, "the over-long line is read again after each close"
    assert t.consumed_bytes == log.stat().st_size  # every byte once (the kept head is not counted)
    assert passes <= (1 << 20) // budget + 2
    append(log, b"tail\nafter\n")
    t.close()
    blocks = drain(t, budget)
    assert lines(blocks) == [(2, "z" * max_line), (3, "after")]  # "tail" ended the cut line
    assert sum(b.truncated_lines for b in blocks) == 1
    # a different file under the same name since the close: the remembered skip does not apply
    t.close()
    os.rename(log, str(log) + ".1")
    append(log, b"fresh\n")
    os.unlink(str(log) + ".1")
    assert lines(drain(t)) == [(1, "fresh")]
    t.close()


def test_a_line_longer_than_the_budget_gets_past_when_closed_every_turn(log: Path) -> None:
    append(log, b"a" * 10_000 + b"\nnext\n")  # below max_line_bytes, but 40 turns of 256 bytes
    t = LogTailer(str(log), chunk_bytes=256)
    got: list[TextBlock] = []
    for _ in range(100):
        got += t.read(256)
        t.close()
        if t.unread_bytes() == 0 and t.position and t.position.offset == log.stat().st_size:
            break
    assert lines(got) == [(1, "a" * 10_000), (2, "next")]
    assert t.consumed_bytes == log.stat().st_size


def test_overlong_unterminated_line_flushes_truncated(log: Path) -> None:
    append(log, b"ok\n" + b"q" * 100)
    t = LogTailer(str(log), max_line_bytes=10, chunk_bytes=8)
    assert lines(drain(t)) == [(1, "ok")]
    assert t.buffered_bytes <= 10
    b = t.flush_partial()
    assert b is not None and lines([b]) == [(2, "q" * 10)] and b.truncated_lines == 1
    t.close()


# ------------------------------------------------------------------ real writer
WRITER = r"""
import os, sys, time
path, n = sys.argv[1], int(sys.argv[2])
f = open(path, "ab", buffering=0)
for i in range(1, n + 1):
    if i == n // 2:  # rename rotation in the middle of the run
        f.close(); os.rename(path, path + ".1"); f = open(path, "ab", buffering=0)
    line = f"step {i} loss={1.0 / i:.6f} \u00e9\u00e8\n".encode()
    f.write(line[:7]); time.sleep(0.0005); f.write(line[7:])  # split mid-line
    if i % 25 == 0:
        time.sleep(0.002)
f.close()
"""


def test_separate_writer_process_all_lines_exactly_once_in_order(log: Path) -> None:
    n = 400
    t = LogTailer(str(log), chunk_bytes=64)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(log), str(n)])
    got: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while len(got) < n and time.monotonic() < deadline:
            got += [s for _, s in lines(t.read(budget_bytes=4096))]
            time.sleep(0.002)
    finally:
        assert proc.wait(timeout=60) == 0
    got += [s for _, s in lines(drain(t))]
    assert got == [f"step {i} loss={1.0 / i:.6f} éè" for i in range(1, n + 1)]
    t.close()


# ------------------------------------------------------------------ errors
def test_unreadable_file_gives_empty_and_an_event(log: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root can read a mode-000 file")
    append(log, b"secret\n")
    os.chmod(log, 0)
    try:
        t = LogTailer(str(log))
        assert t.read() == [] and t.read() == []
        events = t.drain_events()
        assert [k for k, _ in events] == [TailEvent.ERROR]  # reported once, not per poll
        assert "ermission" in events[0][1]
    finally:
        os.chmod(log, 0o644)
    assert lines(t.read()) == [(1, "secret")]
    t.close()


def test_o_noatime_refusal_falls_back(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open, noatime = os.open, getattr(os, "O_NOATIME", 0)
    if not noatime:
        pytest.skip("no O_NOATIME on this platform")

    def fake_open(path, flags, *a):  # type: ignore[no-untyped-def]
        if flags & noatime:
            raise PermissionError(1, "Operation not permitted")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", fake_open)
    append(log, b"a\n")
    t = LogTailer(str(log))
    assert lines(t.read()) == [(1, "a")] and kinds(t) == []
    t.close()


# ------------------------------------------------------------------ property
PIECES = [b"a", b"bc", b"\xc3\xa9", b"\r", b"\n", b"\r\n", b"\x00", b"\xff", b"\xe2\x82", b" "]


def reference(content: bytes, max_line: int) -> list[tuple[str, bool]]:
    raw = content.split(b"\n")
    if raw[-1] == b"":
        raw.pop()
    out = []
    for r in raw:
        head = r[:max_line].replace(b"\x00", b"")
        if head.endswith(b"\r"):
            head = head[:-1]
        out.append((head.decode("utf-8", "replace"), len(r) > max_line))
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    content=st.lists(st.sampled_from(PIECES), max_size=120).map(b"".join),
    data=st.data(),
    max_line=st.sampled_from([3, 8, 1 << 20]),
    chunk=st.integers(1, 16),
)
def test_property_random_writes_reads_restarts(
    content: bytes, data: st.DataObject, max_line: int, chunk: int
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(content)), max_size=12)))
    pieces = [content[a:b] for a, b in zip([0, *cuts], [*cuts, len(content)])]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.log")
        open(path, "wb").close()
        t = LogTailer(path, max_line_bytes=max_line, chunk_bytes=chunk)
        blocks: list[TextBlock] = []
        for piece in pieces:
            with open(path, "ab") as f:
                f.write(piece)
            for _ in range(data.draw(st.integers(0, 2))):
                blocks += t.read(budget_bytes=data.draw(st.integers(1, 40)))
                assert t.buffered_bytes <= max_line + chunk
            if data.draw(st.booleans()):  # agent restart from the persisted position
                pos = t.position
                t.close()
                t = LogTailer(path, pos, max_line_bytes=max_line, chunk_bytes=chunk)
        while True:  # one-shot replay ending: read to the end, then flush
            if more := t.read():
                blocks += more
            elif (last := t.flush_partial()) is not None:
                blocks.append(last)
            else:
                break
        t.close()
    got = lines(blocks)
    want = reference(content, max_line)
    assert [n for n, _ in got] == list(range(1, len(want) + 1))
    assert [s for _, s in got] == [s for s, _ in want]
    assert sum(b.truncated_lines for b in blocks) == sum(tr for _, tr in want)
    assert not blocks or blocks[-1].end_offset == len(content)
