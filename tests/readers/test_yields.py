"""The follower's judgement of files that grow but yield no record (agent/readers/yields.py), on
real files read by the real LogStream; the clock is the ``now`` handed in, so the time rules are
checked without waiting. The daemon tests (tests/daemon/test_unrecognized_logs.py) run the same
through the real agent."""

from __future__ import annotations

from pathlib import Path

from precision_agent.model import LOG_UNRECOGNIZED, make_labels
from precision_agent.readers.logstream import LogStream
from precision_agent.readers.yields import SAMPLE_LINE_CHARS, YieldWatch, chatter, clean_line

MEGATRON = (" iteration {it:>8}/    1000 | consumed samples: {s:>12} | learning rate: 1.000000E-04 | global batch size:"
            "     8 | lm loss: 4.2E+00 | loss scale: 65536.0 | grad norm: 1.5 | number of skipped iterations:   0 |"
            " number of nan iterations:   0 |\n")


class File:
    """A log written by the test, read by a LogStream and judged by a YieldWatch."""

    def __init__(self, path: Path, watch: YieldWatch, labels: dict[str, str] | None = None) -> None:
        self.path, self.watch = path, watch
        path.touch()
        self.stream = LogStream(str(path), labels or {"run": path.stem})

    def write(self, text: str, now: float) -> list:
        with open(self.path, "a") as f:
            f.write(text)
        self.stream.poll()
        st = self.stream.stats
        return self.watch.update(str(self.path), self.stream.base_labels, st.lines - st.chatter, st.records, now,
                                 self.stream.sample_lines)

    def noise(self, n: int, now: float, first: int = 0) -> list:
        return self.write("".join(f"worker {i}: prefetching shard {i}\n" for i in range(first, first + n)), now)

    def records(self, first: int, n: int, now: float) -> list:
        return self.write("".join(MEGATRON.format(it=i, s=8 * i) for i in range(first, first + n)), now)


def verdict(samples: list) -> float | None:
    assert all(s.metric == LOG_UNRECOGNIZED for s in samples)
    return samples[-1].value if samples else None


def test_lines_rule_names_the_file_with_bounded_clean_samples(tmp_path):
    w = YieldWatch(lines=50, after=600, min_lines=10)
    f = File(tmp_path / "train.log", w)
    assert f.noise(10, now=0) == []
    out = f.write("\x1b[31mred\x1b[0m \x07bell\t" + "y" * 1000 + "\n" + "".join(f"line {i}\n" for i in range(45)), now=1)
    (s,) = out
    assert s.value == 1 and s.attr("reason") == "unrecognized" and s.attr("units") == 56
    assert dict(s.labels) == {"run": "train", "file": str(f.path)}
    sample = s.attr("sample").splitlines()
    assert sample == [f"line {i}" for i in range(40, 45)]
    assert w.blind == 1 and w.verdicts() == {str(f.path): "unrecognized"}
    assert clean_line("\x1b[31mred\x1b[0m\x07\tx" + "y" * 1000).startswith("red xyy")  # ANSI, control chars out
    assert len(clean_line("y" * 1000)) == SAMPLE_LINE_CHARS
    # resent at most once a minute while it grows; withdrawn when records come
    assert f.noise(5, now=30) == []
    assert verdict(f.noise(5, now=62)) == 1
    assert verdict(f.records(1, 2, now=70)) == 0
    assert w.blind == 0


def test_a_file_that_only_is_read_never_counts(tmp_path):
    """A static file (data, a finished log) read at start never grows: no verdict, however long."""
    path = tmp_path / "vocab.txt"
    path.write_text("".join(f"token{i}\n" for i in range(5000)))
    w = YieldWatch(lines=50, after=600, min_lines=10)
    stream = LogStream(str(path), {"run": "vocab"})
    stream.poll()
    assert w.update(str(path), stream.base_labels, stream.stats.lines, 0, 0, stream.sample_lines) == []
    assert w.update(str(path), stream.base_labels, stream.stats.lines, 0, 10_000, stream.sample_lines) == []


def test_time_rule_needs_steady_growth_not_a_burst_then_silence(tmp_path):
    w = YieldWatch(lines=2000, after=600, min_lines=100)
    steady = File(tmp_path / "steady.log", w)
    for minute in range(0, 11):
        out = steady.noise(30, now=60.0 * minute, first=30 * minute)
    assert verdict(out) == 1  # 10 minutes growing by 30 lines a minute, no record
    burst = File(tmp_path / "burst.log", w)
    assert burst.noise(500, now=0) == []   # start-up output (an argument dump)
    assert burst.noise(2, now=900) == []   # a 15-minute silent checkpoint load, then a line
    assert burst.noise(2, now=960) == []


def test_progress_bars_and_blank_lines_are_no_units(tmp_path):
    """An evaluation drawing thousands of progress frames between two records is no stop."""
    w = YieldWatch(lines=100, after=600, min_lines=10)
    f = File(tmp_path / "hf.log", w)
    assert verdict(f.records(1, 5, now=0)) == 0  # first records: "fed" said once
    frames = "".join(f"svc-1  |  {i % 100}%|###  | {i}/3000 [00:{i % 60:02d}<00:10,  2.3it/s]\nsvc-1  | \n"
                     for i in range(3000))
    assert chatter(frames) == 6000
    assert f.write(frames, now=60) == []
    assert f.records(6, 1, now=120) == []


def test_records_that_stop_judged_against_the_gaps_seen(tmp_path):
    w = YieldWatch(lines=40, after=600, min_lines=10)
    f = File(tmp_path / "gpt.log", w)
    f.records(1, 3, now=0)
    assert f.noise(30, now=1) == []      # a gap of 30 lines between records
    assert f.records(4, 3, now=2) == []
    assert f.noise(100, now=3) == []     # 100 < 4 x 30: a long gap, not yet a stop
    out = f.noise(30, now=4)             # 130 >= 120
    assert verdict(out) == 1 and out[-1].attr("reason") == "stopped" and out[-1].attr("records") == 6


def test_another_file_of_the_run_with_records_keeps_the_run_fed(tmp_path):
    w = YieldWatch(lines=40, after=600, min_lines=10)
    log = File(tmp_path / "train.log", w)
    err = File(tmp_path / "train.err", w)
    other = File(tmp_path / "other.err", w)
    log.records(1, 3, now=0)
    assert other.noise(5, now=0) == []  # (what a file holds when first seen is no growth)
    assert err.noise(200, now=1) == [] and w.blind == 0
    assert verdict(other.noise(200, now=1)) == 1  # a run of its own: blind
    # the run's log stops yielding while it grows: its verdict stands, and the .err is judged again
    assert verdict(log.noise(200, now=2)) == 1
    assert verdict(err.noise(1, now=3)) == 1
    assert w.blind == 3
    out = log.records(4, 1, now=4)  # records again: the run's verdicts are withdrawn, not other.err's
    assert {dict(s.labels)["file"] for s in out if s.value == 0} == {str(log.path), str(err.path)}
    assert w.blind == 1
    assert verdict(w.forget(str(other.path), now=5)) == 0 and w.blind == 0


def test_zero_lines_turns_it_off(tmp_path):
    w = YieldWatch(lines=0, after=600, min_lines=10)
    f = File(tmp_path / "x.log", w)
    assert f.noise(10_000, now=0) == [] and f.noise(10, now=10_000) == []


def test_labels_keep_rank_but_the_run_ignores_it(tmp_path):
    w = YieldWatch(lines=40, after=600, min_lines=10)
    r0 = File(tmp_path / "train_rank0.log", w, {"run": "train", "rank": "0"})
    r1 = File(tmp_path / "train_rank1.log", w, {"run": "train", "rank": "1"})
    r0.records(1, 2, now=0)
    assert r1.noise(100, now=1) == []  # rank 1 prints no records: rank 0 does, the run is fed
    assert make_labels(run="train", rank="1") == r1.stream.base_labels
