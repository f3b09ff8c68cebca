"""A followed file that idles keeps less (``LogStream.close``: its tailer's position instead of the
tailer, the parser's counts and the copy filter packed), and reads on exactly as if it had never
been closed: its new lines once, copies of its last record still dropped, the per-file parser
context kept, and a restart resumes at the committed position. Real files, a real follower."""

from __future__ import annotations

import gc
from pathlib import Path

from precision_agent.config.agent import Config, Limits, Watch
from precision_agent.health import Health, Heartbeat
from precision_agent.model import LOSS, LOSS_SCALE
from precision_agent.readers.following import Follower
from precision_agent.readers.logstream import LogStream
from precision_agent.readers.tailer import LogTailer
from precision_agent.sources.confine import Confinement

NOTE = "2022-10-19 03:46:58 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, " \
       "setting loss scale to: 0.0001220703125\n"
ROUNDED = "| epoch 001:    300 / 1816 loss=3.1, loss_scale=0.000\n"  # 2^-13 only after the NOTE (per file)


def megatron(i: int) -> str:
    return (f" iteration {i}/ 100 | consumed samples: {i} | elapsed time per iteration (ms): 10.0 | learning rate: "
            f"1.0E-04 | global batch size: 8 | lm loss: {2.0 + i / 8:.4E} | loss scale: 65536.0 | grad norm: 1.5 | "
            "number of skipped iterations: 0 | number of nan iterations: 0 |\n")


def seen(samples) -> list[tuple[str, float, int | None, int]]:
    return [(s.metric, s.value, s.step, s.source.line) for s in samples]


def holds_a_tailer(stream: LogStream) -> bool:
    return any(isinstance(o, LogTailer) for o in gc.get_referents(stream))


def test_an_idle_stream_keeps_less_and_reads_on_as_if_never_closed(tmp_path: Path) -> None:
    first, more = NOTE + megatron(1) + megatron(2), megatron(2) + megatron(3) + ROUNDED + megatron(4)
    idle, kept = tmp_path / "rank3.log", tmp_path / "rank4.log"  # the same lines; ``kept`` is never closed
    for f in (idle, kept):
        f.write_text(first)
    s, ref = LogStream(str(idle), {"job": "j"}), LogStream(str(kept), {"job": "j"})
    assert seen(s.poll(now=0.0)) == seen(ref.poll(now=0.0))
    s.close()
    assert not s.is_open and not holds_a_tailer(s)  # at rest: the position alone
    assert s.position is not None and s.position.offset == len(first.encode()) and s.position.line == 3
    assert s.format == ref.format == "megatron" and s.stats.records == ref.stats.records
    for f in (idle, kept):
        with f.open("a") as out:
            out.write(more)
    got, want = s.poll(now=0.0), ref.poll(now=0.0)
    assert seen(got) == seen(want)
    # the repeated iteration 2 is a copy of the record before the close: dropped, not read twice
    steps = [x.step for x in got if x.metric == LOSS and x.producer == "megatron"]
    assert steps == [3, 4] and s.stats.duplicates == ref.stats.duplicates == 1
    # the fairseq NOTE read before the close still gives the rounded scale its value (per-file parser)
    assert [x.value for x in got if x.metric == LOSS_SCALE and x.source.line == 6] == [2.0 ** -13]
    assert [x.source.line for x in got if x.metric == LOSS and x.producer == "megatron"] == [5, 7]
    assert s.is_open and holds_a_tailer(s) and s.format == "megatron" and not s.parser.errors
    s.close()
    ref.close()


def test_a_copy_too_far_back_to_matter_is_forgotten_at_rest(tmp_path: Path) -> None:
    """The copy filter compares a record with its producer's previous one within DUP_RECORDS lines:
    at rest a record further back than that is dropped, and the same text later is read."""
    log = tmp_path / "train.log"
    log.write_text(megatron(1) + "some chatter\n" * 40)
    s = LogStream(str(log))
    assert len(s.poll(now=0.0)) > 0
    s.close()
    with log.open("a") as out:
        out.write(megatron(1))  # 41 lines after the first: a genuine repeat, not a copy
    assert [x.step for x in s.poll(now=0.0) if x.metric == LOSS] == [1] and s.stats.duplicates == 0
    s.close()


def follower(logs: Path, got: list) -> Follower:
    config = Config(watches=[Watch(path=logs)], limits=Limits(max_open_files=4))
    return Follower(config, Health(), Confinement(config.watches), Heartbeat("test"), got.extend, lambda p: None,
                    lambda p: None, lambda: False)


def test_idle_files_past_the_descriptor_budget_read_on_and_resume_after_a_restart(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    paths = [logs / f"rank{i}.log" for i in range(8)]
    for p in paths:
        p.write_text(megatron(1) + megatron(2))
    got: list = []
    f = follower(logs, got)
    f.read(f.resync(lambda p: None))
    assert len([x for x in got if x.metric == LOSS]) == 16
    resting = [p for p in map(str, paths) if not f.streams[p].is_open]
    assert len(resting) >= 4 and not any(holds_a_tailer(f.streams[p]) for p in resting)  # compacted
    assert all(f.streams[p].format == "megatron" and f.streams[p].stats.records == 2 for p in resting)
    for p in paths:
        with p.open("a") as out:
            out.write(megatron(2) + megatron(3))  # a copy of the last record, then a new one
    got.clear()
    f.read(f.resync(lambda p: None))
    assert sorted((x.source.path, x.step, x.source.line) for x in got if x.metric == LOSS) == \
        sorted((str(p), 3, 4) for p in paths)
    assert all(f.streams[str(p)].stats.duplicates == 1 and f.streams[str(p)].format == "megatron" for p in paths)
    committed = f.positions(f.streams)
    f.close()
    for p in paths:
        with p.open("a") as out:
            out.write(megatron(4))
    got.clear()
    g = follower(logs, got)  # a restart: the committed positions, nothing read twice
    g.offsets = dict(committed)
    g.read(g.resync(lambda p: None))
    assert sorted((x.source.path, x.step, x.source.line) for x in got if x.metric == LOSS) == \
        sorted((str(p), 4, 5) for p in paths)
    g.close()
