"""CSV metric logs (readers/metriccsv.py) as Lightning's CSVLogger writes them: the real file, and
the same rows as the logger wrote them before its mid-run rewrite with a new header."""

from __future__ import annotations

import math
import os

from precision_agent.readers.streams import open_stream
from precision_agent.readers.tailer import TailEvent
from support.metricfiles import LIGHTNING_NAN_STEP, before_rewrite, csv_file


def pairs(samples) -> list[tuple[str, int, float]]:
    return [(s.metric, s.step, s.value) for s in samples]


def test_real_csvlogger_file():
    s = open_stream(str(csv_file("lightning_nan")))
    samples = s.finish(now=0.0)
    assert s.format == "csv" and s.stats.skipped == 0
    loss = {st: v for m, st, v in pairs(samples) if m == "loss"}
    assert loss and all(math.isfinite(v) for st, v in loss.items() if st < LIGHTNING_NAN_STEP)
    assert any(math.isnan(v) for st, v in loss.items() if st >= LIGHTNING_NAN_STEP)
    assert {m for m, _, _ in pairs(samples)} == {"loss", "lr", "grad_norm", "eval_loss"}
    # train_loss_epoch (the epoch mean) is not read: one loss per step
    assert len(loss) == len([1 for m, _, _ in pairs(samples) if m == "loss"])


def test_the_header_rewrite_is_not_a_new_run_and_nothing_is_read_twice(tmp_path):
    early, final = before_rewrite("lightning_ok")
    path = tmp_path / "metrics.csv"
    path.write_bytes(early)
    s = open_stream(str(path))
    first = s.poll(now=0.0)
    with open(path, "wb") as f:  # the logger's rewrite: open("w"), every row again, then new ones
        f.write(b"\n".join(final.split(b"\n")[:6]))  # caught while it is being written: 5 rows of 12
    assert s.poll(now=0.0) == [] and not s.tailer.drain_events()
    with open(path, "wb") as f:
        f.write(final)
    rest = s.poll(now=0.0)
    whole = open_stream(str(csv_file("lightning_ok"))).finish(now=0.0)
    assert pairs(first) + pairs(rest) == pairs(whole)
    assert "grad_norm" in {m for m, _, _ in pairs(rest)} and not s.tailer.drain_events()


def test_a_rewrite_while_the_agent_was_away(tmp_path):
    early, final = before_rewrite("lightning_ok")
    path = tmp_path / "metrics.csv"
    path.write_bytes(early)
    s = open_stream(str(path))
    first = s.poll(now=0.0)
    saved = s.position
    s.close()
    path.write_bytes(final)  # same inode, rewritten
    again = open_stream(str(path), position=saved)
    rest = again.poll(now=0.0)
    assert pairs(first) + pairs(rest) == pairs(open_stream(str(path)).finish(now=0.0))


def test_torn_last_row_waits_and_nan_and_empty_cells(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"epoch,step,train_loss_step,val_loss\r\n0,0,1.5,\r\n0,1,nan,\r\n0,2,0.")
    s = open_stream(str(path))
    assert pairs(s.poll(now=0.0))[1][:2] == ("loss", 1) and s.position.line == 3
    assert math.isnan(pairs(open_stream(str(path)).poll(now=0.0))[1][2])
    with open(path, "ab") as f:
        f.write(b"5,2.25\r\n")
    assert pairs(s.poll(now=0.0)) == [("loss", 2, 0.5), ("eval_loss", 2, 2.25)]
    path2 = tmp_path / "b" / "metrics.csv"
    path2.parent.mkdir()
    path2.write_bytes(b"step,loss\n1,2.0\n2,1.")
    assert pairs(open_stream(str(path2)).finish(now=0.0)) == [("loss", 1, 2.0), ("loss", 2, 1.0)]


def test_another_runs_file_under_the_same_name_is_read_from_its_start(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"step,loss,grad_norm\n" + b"".join(b"%d,1.0,2.0\n" % i for i in range(50)))
    s = open_stream(str(path))
    assert len(s.poll(now=0.0)) == 100
    with open(path, "wb") as f:  # truncated in place; fewer columns and rows
        f.write(b"step,loss\n0,3.0\n")
    assert pairs(s.poll(now=0.0)) == [("loss", 0, 3.0)]
    assert [e for e, _ in s.tailer.drain_events()] == [TailEvent.TRUNCATED]


def test_hostile_rows_are_counted_not_fatal(tmp_path):
    path = tmp_path / "metrics.csv"
    huge = b"9" * 5000
    path.write_bytes(b"step,loss\n1,1.0\n2,\"unterminated\n\0\0\0,\0\n3,\"1\"\"2\"\n4," + huge + b"\n5,2.0\n"
                     b"6," + b"x" * 3000 + b"\n7,nan\n")
    s = open_stream(str(path), max_line_bytes=1024)
    out = pairs(s.finish(now=0.0))
    assert out[0] == ("loss", 1, 1.0) and ("loss", 5, 2.0) in out and out[-1][:2] == ("loss", 7)
    assert s.stats.skipped >= 2 and s.position.offset == os.path.getsize(path)


def test_run_identity_of_structured_files():
    from precision_agent.readers.runs import run_labels
    hf = "/data/out/runs/Nov28_04-00-00_host/events.out.tfevents.1700000000.host.1.0"
    assert run_labels(hf, "file", {}) == {"run": "Nov28_04-00-00_host"}
    a = run_labels("/data/exp1/lightning_logs/version_3/metrics.csv", "file", {})
    b = run_labels("/data/exp2/lightning_logs/version_3/metrics.csv", "file", {})
    assert a == {"run": "exp1_lightning_logs_version_3"} and a != b
    assert run_labels("/data/exp1/lightning_logs/version_3/metrics.csv", "file", {"run": "mine"}) == {"run": "mine"}
    assert run_labels("/data/tb/events.out.tfevents.1.h.2.0", "parent_dir", {}) == {"run": "tb"}


def test_a_row_over_the_limit_is_skipped_unread_and_the_rows_after_it_are_read(tmp_path):
    """At the default limit (1 MiB, the read chunk too) a longer row stopped the file for good."""
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"step,loss\n1,0.5\n2," + b"7" * (1 << 20) + b"\n3,nan\n")
    s = open_stream(str(path))
    out = pairs(s.poll(now=0.0))
    assert out[0] == ("loss", 1, 0.5) and out[1][:2] == ("loss", 3) and math.isnan(out[1][2]) and len(out) == 2
    assert s.stats.skipped == 1 and "skipped unread" in s.parser.errors[0]
    assert s.position.offset == os.path.getsize(path) and s.position.line == 4


def test_rows_longer_than_a_read_but_within_the_limit_are_read(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"step,loss,note\n1,1.5," + b",".join([b"x" * 1023] * 2048) + b"\n2,nan,\n")  # 2 MiB
    s = open_stream(str(path), max_line_bytes=4 << 20)
    out = pairs(s.poll(now=0.0))
    assert out[0] == ("loss", 1, 1.5) and out[1][:2] == ("loss", 2) and s.stats.skipped == 0
    small = tmp_path / "b" / "metrics.csv"
    small.parent.mkdir()
    small.write_bytes(b"step,loss,note\n1,2.5," + b"x" * 500 + b"\n2,nan,\n")
    s = open_stream(str(small))
    got = [p for _ in range(4) for p in pairs(s.poll(budget_bytes=100, now=0.0))]  # a budget under a row
    assert got[0] == ("loss", 1, 2.5) and got[1][:2] == ("loss", 2)


def test_an_unterminated_long_row_is_searched_once_and_is_no_backlog(tmp_path, monkeypatch):
    from precision_agent.readers.filecursor import FileCursor
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"step,loss\n1,0.5\n2," + b"7" * (3 << 20))
    s = open_stream(str(path))
    looked = []
    real = FileCursor.pread
    monkeypatch.setattr(FileCursor, "pread", lambda self, n, at: looked.append(len(b := real(self, n, at))) or b)
    assert pairs(s.poll(now=0.0)) == [("loss", 1, 0.5)]
    assert s.tailer.unread_bytes() == 0 and s.position.line == 2
    first = sum(looked)
    for _ in range(3):
        assert s.poll(now=0.0) == []
    assert sum(looked) - first < 64 << 10, "the long row was scanned again at every poll"
    with open(path, "ab") as f:
        f.write(b"7" * (1 << 20) + b"\n3,nan\n")
    out = pairs(s.poll(now=0.0))
    assert [m for m, st, _ in out] == ["loss"] and out[0][1] == 3 and math.isnan(out[0][2])
    assert sum(looked) - first < (1 << 20) + (64 << 10) and s.stats.skipped == 1


def test_start_at_end_keeps_the_header_and_counts_the_rows_already_there(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"step,loss\n1,nan\n2,0.5\n3,0.")
    s = open_stream(str(path), start_at_end=True)
    assert s.poll(now=0.0) == [] and s.position.line == 3
    with open(path, "ab") as f:
        f.write(b"25\n4,nan\n")
    out = pairs(s.poll(now=0.0))
    assert out[0] == ("loss", 3, 0.25) and out[1][:2] == ("loss", 4) and s.position.line == 5
    early, final = before_rewrite("lightning_ok")  # the logger's rewrite after start_at_end
    path2 = tmp_path / "b" / "metrics.csv"
    path2.parent.mkdir()
    path2.write_bytes(early)
    s = open_stream(str(path2), start_at_end=True)
    assert s.poll(now=0.0) == []
    path2.write_bytes(final)
    rest = pairs(s.poll(now=0.0))
    full = open_stream(str(path2)).finish(now=0.0)
    old_rows = early.count(b"\n") - 1
    assert rest and rest == [p for p, x in zip(pairs(full), full) if x.source.line > old_rows + 1]


def test_start_at_end_reads_a_file_that_appears_or_fills_later_in_full(tmp_path):
    path = tmp_path / "metrics.csv"
    s = open_stream(str(path), start_at_end=True)  # not there yet: a new run's file
    assert s.poll(now=0.0) == []
    path.write_bytes(b"step,loss\n1,nan\n")
    assert pairs(s.poll(now=0.0))[0][:2] == ("loss", 1)
    empty = tmp_path / "b" / "metrics.csv"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    s = open_stream(str(empty), start_at_end=True)
    assert s.poll(now=0.0) == []
    empty.write_bytes(b"step,loss\n1,nan\n")  # (the logger's first flush)
    assert pairs(s.poll(now=0.0))[0][:2] == ("loss", 1)
