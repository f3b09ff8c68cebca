"""Parser objects are shared by every followed file (memory with ten thousand files), while a
parser that keeps per-file context gets one instance per file, made only when needed."""

import tracemalloc

from precision_agent.model import LOSS_SCALE
from precision_agent.readers.logstream import LogStream
from precision_agent.readers.parsers import Block, CompositeParser

NOTE = "2022-10-19 03:46:58 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, " \
       "setting loss scale to: 0.0001220703125\n"
ROUNDED = "| epoch 001:    300 / 1816 loss=3.1, loss_scale=0.000\n"  # 2^-13 printed with 3 decimals
MEGATRON = " iteration 5/10 | lm loss: 2.5 | loss scale: 8.0 |\n"


def scales(records):
    return [v for r in records for m, v, _ in r.values if m == LOSS_SCALE]


def test_stateless_parsers_are_shared_and_per_file_context_is_not():
    a, b = CompositeParser(), CompositeParser()
    assert len(a.parsers) > 10 and all(x is y for x, y in zip(a.parsers, b.parsers))
    assert scales(a.parse(Block(NOTE))) == [2.0 ** -13]
    # b never saw the note: a rounded 0.000 is not a scale there ...
    assert scales(b.parse(Block(ROUNDED))) == []
    # ... while in a it is the scale the note announced
    assert scales(a.parse(Block(ROUNDED))) == [2.0 ** -13]


def test_per_file_instance_only_once_its_producer_shows_up():
    p = CompositeParser()
    p.parse(Block(MEGATRON))
    assert p._own is None
    p.parse(Block(NOTE))
    assert p._own is not None and list(p._own) == ["fairseq"]


def test_user_patterns_are_shared_too():
    pattern = r"step (?P<step>\d+) scale (?P<loss_scale>\S+)"
    a, b = CompositeParser("custom", pattern), CompositeParser("auto", pattern)
    assert a.parsers[0] is b.parsers[0] and a.parsers[0].name == "custom"
    assert scales(a.parse(Block("step 3 scale 4.0\n"))) == [4.0]


def test_memory_per_followed_file_is_small(tmp_path):
    """A followed file costs well under the 10 kB that 10^4 files within a 100 MB budget allow."""
    paths = []
    for i in range(300):
        paths.append(tmp_path / f"rank{i}.log")
        paths[-1].write_text(MEGATRON)
    CompositeParser()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        streams = [LogStream(str(p), {"job": "j"}) for p in paths]
        for s in streams:
            assert len(s.poll(now=0.0)) == 2
            s.close()  # as the follower closes an idle file: at rest (logstream.py)
        per_file = (tracemalloc.get_traced_memory()[0] - before) / len(streams)
    finally:
        tracemalloc.stop()
    assert per_file < 1200, per_file  # ~700 at rest (1,300 before: a closed tailer, parser, dicts)
