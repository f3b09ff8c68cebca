"""Hostile log input never crashes the reader/parsers: random bytes, NULs, invalid UTF-8,
huge lines, and fragments of real record shapes glued together."""

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_agent.readers.logstream import LogStream
from precision_agent.readers.parsers import Block, CompositeParser

FRAGMENTS = [
    b" iteration 12/ 100 | lm loss: ", b"nan", b"inf", b" | loss scale: ", b"1e309", b"-0.0",
    b"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: ", b", reducing to ", b"|",
    b"{'loss': ", b", 'grad_norm': ", b"}", b"\r", b"\n", b"\x00", b"\xff\xfe", b"\x1b[31m", b"step=",
    b", skipped=", b"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to ",
    b'{"loss": "', b'"}', b"[rank3]:", b"validation loss at iteration 9 | lm loss value: ", b"9" * 400,
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.binary(max_size=64)), max_size=60))
def test_parsers_survive_any_block(parts):
    text = b"".join(parts).decode("utf-8", errors="replace").replace("\x00", "")
    parser = CompositeParser()
    for rec in parser.parse(Block(text + "\n", 1)):
        assert rec.line >= 1
        for metric, value, _attrs in rec.values:
            assert isinstance(metric, str) and isinstance(value, float)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.binary(max_size=256)), max_size=40))
def test_stream_survives_any_file(tmp_path_factory, parts):
    path = tmp_path_factory.mktemp("h") / "x.log"
    path.write_bytes(b"".join(parts))
    stream = LogStream(str(path), {"run": "r"}, max_line_bytes=4096, chunk_bytes=97)
    try:
        samples = stream.poll() + stream.finish()
    finally:
        stream.close()
    assert all(s.source.line >= 1 for s in samples)


def test_binary_garbage_huge_line_and_nuls(tmp_path):
    path = tmp_path / "x.log"
    good = (b" iteration        7/     100 | lm loss: 2.500000E+00 | loss scale: 1024.0 | grad norm: 1.0 |"
            b" number of skipped iterations:   0 | number of nan iterations:   0 |\n")
    path.write_bytes(os.urandom(1 << 20) + b"\n" + b"A" * (10 << 20) + b"\n" + b"\x00" * 1000 + good)
    stream = LogStream(str(path), {}, max_line_bytes=1 << 20)
    try:
        samples = stream.poll(64 << 20) + stream.finish()
    finally:
        stream.close()
    assert stream.stats.truncated_lines >= 1
    assert [(s.metric, s.value) for s in samples if s.step == 7][:2] == [("loss", 2.5), ("loss_scale", 1024.0)]


def test_a_failing_parser_or_rule_is_contained(tmp_path, monkeypatch):
    """A bug in one parser or one detector costs that parser/rule, not the file or the batch."""
    from precision_agent.detectors.loss_scale import LossScaleDetector
    from precision_agent.engine.pipeline import Pipeline
    from precision_agent.readers.parsers.deepspeed import DeepSpeedParser
    from precision_agent.engine.rulefile import default_rules_dir, load_rules

    def boom(self, *a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(DeepSpeedParser, "parse", boom)
    monkeypatch.setattr(LossScaleDetector, "observe", boom)
    path = tmp_path / "x.log"
    path.write_text(" iteration        7/     100 | lm loss: nan | loss scale: 1.0 | grad norm: 1.0 |"
                    " number of skipped iterations:   0 | number of nan iterations:   0 |\n"
                    "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4, reducing to 2\n")
    stream = LogStream(str(path), {})
    samples = stream.finish()
    assert any("deepspeed parser failed" in e for e in stream.parser.errors)
    p = Pipeline(load_rules([default_rules_dir()]))
    findings = p.process(samples)
    assert {f.rule for f in findings} == {"TrainingNonFinite"}  # the NaN loss still pages
    assert any("LossScale" in e for e in p.errors)
