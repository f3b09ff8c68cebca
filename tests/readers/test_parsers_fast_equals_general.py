"""The fast paths of the reader give exactly what the general paths give.

Megatron lines of the usual shape are read by one regex match; any other shape goes through the
per-field path. A differential property test builds lines from real and tricky field names (in
and out of order, repeated, names that end with a known one, values with colons, NaN spellings)
and checks the parser against a reference that uses only the general path.
"""

import gc
import math
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from precision_agent.readers.logstream import LogStream
from precision_agent.readers.parsers import Block, CompositeParser
from precision_agent.readers.parsers import megatron
from precision_agent.readers.parsers.base import Record

# the iteration regex as it was before the fast path, and the general field reader
_REFERENCE_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|([^\n]*)")


def reference(text: str, first_line: int = 1) -> list[Record]:
    block, out = Block(text, first_line), []
    for m in _REFERENCE_RE.finditer(text):
        values = megatron._general(m.group(3))
        if values is None:
            continue
        pos = m.start()
        out.append(Record(block.line_of(pos), pos, values, int(m.group(1)), block.log_time_at(pos),
                          block.rank_at(pos), "megatron"))
    return out


def same(a: list[Record], b: list[Record]) -> bool:
    def key(r: Record):
        vals = [(m, "nan" if math.isnan(v) else v, attrs) for m, v, attrs in r.values]
        return r.line, r.pos, r.step, r.log_time, r.rank, vals
    return [key(r) for r in a] == [key(r) for r in b]


BENCH_LINE = (" [2024-09-03 15:56:55] iteration       20/  500000 | consumed samples:        20480 | elapsed time per "
              "iteration (ms): 12137.8 | throughput per GPU (TFLOP/s/GPU): 872.5 | learning rate: 6.976744E-07 | global "
              "batch size:  1024 | lm loss: 1.064275E+01 | loss scale: 262144.0 | grad norm: 47.021 | number of skipped"
              " iterations:   5 | number of nan iterations:   0 |")
DEEPSPEED_SHAPE = (" iteration     7193/  320000 | consumed samples:       115088 | consumed tokens:    471400448 | "
                   "elapsed time per iteration (ms): 4411.2 | learning rate: 1.998E-04 | global batch size:    16 | "
                   "lm loss: 3.214400E+00 | loss scale: 1.0 | actual seqlen:  4096 | grad norm: nan | num zeros: 0.0 | "
                   "number of skipped iterations:   0 | number of nan iterations:   3 | samples per second: 3.627 |")


def test_usual_shapes_take_the_fast_path_and_agree():
    for line in (BENCH_LINE, DEEPSPEED_SHAPE):
        m = megatron._ITER_RE.search(line)
        assert m is not None and m.groups()[-1] is None, "the usual shape must not fall back to the general path"
        recs = megatron.MegatronParser().parse(Block(line + "\n", 7))
        assert same(recs, reference(line + "\n", 7)) and len(recs) == 1


def test_unusual_shapes_fall_back_and_agree():
    odd = [
        " iteration 5/10 | loss scale: 8.0 | lm loss: 2.5 | learning rate: 1e-4 |",       # known fields out of order
        " iteration 5/10 | xlm loss: 9.0 | lm loss: 2.5 |",                                # name ending with a known one
        " iteration 5/10 | decoupled learning rate: 1.0 | learning rate: 2.0 |",
        " iteration 5/10 | lm loss: 2.5 | lm loss: 3.5 |",                                 # repeated
        " iteration 5/10 | note: a:b | lm loss: 2.5 |",                                    # colon inside a value
        " iteration 5/10 | lm loss: nan.0 | grad norm: -Infinity | loss scale: 'inf' |",
        " iteration 5/10 | elapsed: 3 |",                                                  # not a training line
        "subiteration 5/10 | lm loss: 2.5 | iteration 6/10 | lm loss: 1.5 |",              # \b before iteration
    ]
    text = "\n".join(odd) + "\n"
    assert same(megatron.MegatronParser().parse(Block(text)), reference(text))


NAMES = ["consumed samples", "elapsed time per iteration (ms)", "learning rate", "global batch size", "lm loss",
         "loss scale", "grad norm", "num zeros", "number of skipped iterations", "number of nan iterations",
         "xlm loss", "decoupled learning rate", "lm loss value", "samples per second", "sop loss", "weird name"]
VALUES = ["6.5E+00", " 1.0 ", "nan", "NaN", "nan.0", "inf", "-inf", "Infinity", "0", "  0 ", " 00 ", "3",
          "0.0", "", "abc", "1:2", "1e400", " 2_0 ", "\t0"]
PREFIXES = ["", " ", " [2024-09-03 15:56:55] ", "[2024-09-03T15:56:55] ", "\t [2024-09-03 15:56:59] ",
            "x [2024-09-03 15:56:55] ", "2024-01-02 03:04:05 [2024-09-03 15:56:55] ", " " * 99 + "[2024-09-03 15:56:55] ",
            " " * 97 + "[2024-09-03 15:56:55] ", "[rank3]: [2024-09-03 15:56:55] ", "[2024-09-03 15:56:55,5] ",
            "[rank3]: ", "> ", "2024-01-02T03:04:05.123 x ", "[default7]: [2023-10-31 08:58:26,908] "]


@st.composite
def iteration_lines(draw):
    segs = draw(st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(VALUES)), max_size=12))
    body = "".join(f" {n}: {v} |" for n, v in segs)
    tail = draw(st.sampled_from(["", "  ", " trailing", " x: y", " |"]))
    return f"{draw(st.sampled_from(PREFIXES))}iteration {draw(st.integers(0, 10**6))}/ 99 |{body}{tail}"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(iteration_lines(), st.sampled_from(["", "noise", " time (ms) | fwd: 1.0 |"])),
                min_size=1, max_size=8), st.integers(1, 1000))
def test_fast_path_equals_general_path(lines, first_line):
    text = "\n".join(lines) + "\n"
    assert same(megatron.MegatronParser().parse(Block(text, first_line)), reference(text, first_line))


def test_line_numbers_in_any_order_of_asking():
    text = "".join(f"line {i}\n" for i in range(50))
    block = Block(text, 10)
    positions = [text.index(f"line {i}\n") + 2 for i in (3, 40, 7, 7, 49, 0, 25)]
    assert [block.line_of(p) for p in positions] == [13, 50, 17, 17, 59, 10, 35]


def test_timestamps_with_and_without_fraction():
    for stamp, want in (("2024-09-03 15:56:55", 1725379015.0), ("2024-09-03T15:56:55,5", 1725379015.5),
                        ("2024-09-03 15:56:55.123456", 1725379015.123456)):
        rec = Block(f"[{stamp}] iteration 1/2 | lm loss: 1.0 |\n").record(len(stamp) + 3, 1, "x")
        assert rec.log_time == want and isinstance(rec.log_time, float)


def test_claimed_lines_are_not_read_again_by_fallbacks():
    text = BENCH_LINE + "\nstep 3 loss 0.5\n"  # the second line is for the generic user-print parser
    recs = CompositeParser().parse(Block(text))
    assert [(r.producer, r.line) for r in recs] == [("megatron", 1), ("user_print", 2)]


def test_reader_pauses_collection_only_while_reading(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(BENCH_LINE + "\n")
    stream = LogStream(str(log))
    assert gc.isenabled()
    assert len(stream.poll()) == 5 and gc.isenabled()
    gc.disable()
    try:
        log.write_text(BENCH_LINE + "\n" + BENCH_LINE.replace("   20/", "   30/") + "\n")
        stream.poll()
        assert not gc.isenabled(), "whoever disabled collection keeps it disabled"
    finally:
        gc.enable()
        stream.close()


# -- layout regexes: a block's usual layout read by a regex made for it -------------------------

@st.composite
def layout_blocks(draw):
    """Lines that mostly share one layout (so the layout regex reads them), with values, prefixes
    and stray lines of other shapes that must leave them to the general regex."""
    layout = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=10))
    lines = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.integers(0, 9))
        if kind < 6:
            body = "".join(f" {n}: {draw(st.sampled_from(VALUES))} |" for n in layout)
            prefix = draw(st.sampled_from(["", " ", " [2024-09-03 15:56:55] ", "\t[2024-09-03T15:59:01]  ",
                                           " " * 97 + "[2024-09-03 15:56:55] ", " " * 101 + "[2024-09-03 15:56:55] ", "  "]))
            tail = draw(st.sampled_from(["", "", "  ", " trailing", " x: y"]))
            lines.append(f"{prefix}iteration {draw(st.integers(0, 10**6))}/ 99 |{body}{tail}")
        elif kind < 8:
            lines.append(draw(iteration_lines()))
        else:
            lines.append(draw(st.sampled_from(["", "noise", " validation loss at iteration 5 | lm loss value: 2.0 |",
                                               " saved checkpoint at iteration 7", "iteration\n  5/10 | lm loss: 1 |"])))
    return "\n".join(lines) + "\n"


def _is_eval(r: Record) -> bool:
    return bool(r.values) and r.values[0][0] == "eval_loss"


@settings(max_examples=400, deadline=None)
@given(layout_blocks(), st.integers(1, 1000))
def test_layout_regex_equals_general_path(text, first_line):
    got = [r for r in megatron.MegatronParser().parse(Block(text, first_line)) if not _is_eval(r)]
    assert same(got, reference(text, first_line))


def test_usual_layouts_are_read_by_their_layout_regex():
    for line in (BENCH_LINE, DEEPSPEED_SHAPE, BENCH_LINE.replace(" [2024-09-03 15:56:55]", "")):
        layout = megatron._first_layout(line + "\n")
        assert layout is not None and layout.fullmatch("\n" + line) is not None
    # a layout the general regex would not read as the usual shape gets no layout regex
    assert megatron._layout_re(("lm loss", "learning rate")) is None  # out of Megatron's order
    assert megatron._layout_re(("lm loss", "lm loss")) is None
    assert megatron._layout_re(("lm loss", "xlm loss")) is None  # not a field Megatron prints


def test_many_layout_lines_with_others_between():
    """Runs of layout lines, lines of another layout, validation, checkpoint and noise lines: the
    parser's records and claimed spans are those of the general path."""
    other = " iteration 9/10 | loss scale: 8.0 | lm loss: 2.5 |"
    lines = []
    for i in range(60):
        lines.append(BENCH_LINE.replace("   20/", f"{i:5d}/"))
        if i % 7 == 3:
            lines.append(other)
        if i % 11 == 5:
            lines.append(" validation loss at iteration 40 | lm loss value: 2.0 | lm loss PPL: 7.4 |")
        if i % 13 == 0:
            lines.append("  successfully saved checkpoint at iteration 40 to /ckpt")
    text = "\n".join(lines) + "\n"
    recs, spans = megatron.MegatronParser().parse_spans(Block(text, 3))
    iters = [r for r in recs if not _is_eval(r)]
    assert same(iters, reference(text, 3)) and len(iters) == 60 + 9
    assert [r.pos for r in recs] == sorted(r.pos for r in recs)
    assert all(r.end in (-1, text.find("\n", r.pos)) for r in recs) and sum(r.end >= 0 for r in recs) >= 60
    claimed = {text.rfind("\n", 0, r.pos) + 1 for r in recs}
    covered = {i for s, e in spans for i in range(s, e + 1) if i == 0 or text[i - 1] == "\n"}
    assert covered == claimed  # every claimed line start, and nothing else, is inside a span


def test_claimed_runs_are_blanked_for_later_parsers():
    """Adjacent Megatron lines are claimed as one span; a later parser that wants the block still
    sees them blanked line by line (its own records keep their true line numbers)."""
    lines = [BENCH_LINE.replace("   20/", f"{i:5d}/") for i in range(5)]
    lines[2:2] = ["step 3 loss 0.5"]
    lines.append("step 4 loss 0.25")
    recs = CompositeParser().parse(Block("\n".join(lines) + "\n", 10))
    assert [(r.producer, r.line) for r in recs] == [("megatron", 10), ("megatron", 11), ("user_print", 12),
                                                   ("megatron", 13), ("megatron", 14), ("megatron", 15),
                                                   ("user_print", 16)]


def test_reader_samples_equal_samples_built_the_usual_way(tmp_path):
    from precision_agent.model import Sample, SourcePos
    log = tmp_path / "train.log"
    log.write_text(BENCH_LINE + "\n")
    stream = LogStream(str(log))
    try:
        got = stream.finish(now=5.0)
    finally:
        stream.close()
    src = SourcePos(str(log), 1)
    want = [Sample((), m, v, 20, src, 5.0, 1725379015.0, a, "megatron") for m, v, a in
            megatron.MegatronParser().parse(Block(BENCH_LINE + "\n"))[0].values]
    assert got == want and [hash(s.source) for s in got] == [hash(src)] * len(want)
    assert all(type(s) is Sample and type(s.source) is SourcePos for s in got)
