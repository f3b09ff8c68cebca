"""Parsing throughput: a large Megatron-format log through the agent's reader (tailer, ANSI strip,
every registered parser, copy filter, typed samples) against a plain Python line loop over the
same file, measured in the same run; the tailer alone and the tailer with the parsers (no samples)
show where the reader's time goes. Also the full pipeline (series state and shipped rules), and the
same file read as a user-defined ``format: custom`` (a ``pattern`` for these lines, matched by RE2 as
every user regex is: agent/config/regex.py), for the cost of the user's regex against the built-in
parser.

Goals (issues 13 and 21, catch-up speed): the reader alone at least 150k lines/s, the whole
pipeline (series state and the shipped rules) at least 100k lines/s, 50k at the least; the ratio
to the plain loop is shown for reference (no compiled reader: decided in issue 13). The pipeline's
own part (the whole less the reader) is reported too: it is what the series state and the rules
cost per line (a backlog is judged in runs, each rule in bulk where its plan proves it quiet:
agent/engine/catchup.py). On a loaded host compare the ratios of one run, not the figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import common

GOAL_LINES_PER_S = 150_000           # reader + parsers + samples
GOAL_PIPELINE_LINES_PER_S = 100_000  # + series state + shipped rules (issue 21)
MIN_PIPELINE_LINES_PER_S = 50_000    # ... at the least (issue 13)
# what a user writes for these lines (README, `pattern`): the four values the built-in parser reads
CUSTOM_PATTERN = (r"iteration\s+(?P<step>\d+)/\s*\d+ \|.*?learning rate: (?P<lr>\S+) \|.*?lm loss: (?P<loss>\S+) \|"
                  r".*?loss scale: (?P<loss_scale>\S+) \|.*?grad norm: (?P<grad_norm>\S+) \|")


def _write_log(path: Path, lines: int) -> None:
    """Mostly iteration lines with the noise real Megatron logs carry between them."""
    with open(path, "w", encoding="utf-8") as f:
        for it in range(1, lines + 1):
            if it % 10 == 0:
                f.write(" time (ms) | forward-compute: 1523.4 | backward-compute: 3120.7 | optimizer: 12.9 |\n")
            else:
                f.write(common.megatron_line(it, loss=6.5 - it * 1e-6, when=1_700_000_000 + it))


def run(lines: int = 500_000, repeat: int = 3) -> dict[str, Any]:
    from precision_agent.engine.pipeline import Pipeline
    from precision_agent.readers.logstream import LogStream
    from precision_agent.engine.rulefile import default_rules_dir, load_rules

    with tempfile.TemporaryDirectory(prefix="pa-parse-") as tmp:
        path = Path(tmp) / "megatron.log"
        _write_log(path, lines)
        size = path.stat().st_size

        def plain() -> None:
            n = 0
            with open(path, encoding="utf-8", errors="replace") as f:
                for _line in f:
                    n += 1

        def tail() -> None:  # reading and decoding alone, the floor under the reader's time
            from precision_agent.readers.tailer import LogTailer
            tailer = LogTailer(str(path))
            try:
                while tailer.read(1 << 30):
                    pass
            finally:
                tailer.close()

        def parsers() -> None:  # tailer and parsers without the samples: where the reader's time goes
            from precision_agent.readers.parsers import Block, CompositeParser
            from precision_agent.readers.tailer import LogTailer
            composite, tailer = CompositeParser(), LogTailer(str(path))
            try:
                while blocks := tailer.read(1 << 30):
                    for tb in blocks:
                        composite.parse(Block(tb.text, tb.first_line))
            finally:
                tailer.close()

        samples = [0]

        def parse() -> None:
            stream = LogStream(str(path))
            try:
                samples[0] = len(stream.finish(now=0.0))
            finally:
                stream.close()

        custom_samples = [0]

        def custom() -> None:  # the reader with the user's regex instead of the built-in parsers
            stream = LogStream(str(path), fmt="custom", pattern=CUSTOM_PATTERN)
            try:
                custom_samples[0] = len(stream.finish(now=0.0))
            finally:
                stream.close()

        rules = load_rules([default_rules_dir()])

        def full() -> None:
            stream = LogStream(str(path))
            try:
                Pipeline(rules.fresh()).process(stream.finish(now=0.0))
            finally:
                stream.close()

        t_plain = common.best_of(plain, repeat)
        t_tail = common.best_of(tail, repeat)
        t_parsers = common.best_of(parsers, repeat)
        t_parse = common.best_of(parse, repeat)
        t_full = common.best_of(full, max(1, repeat - 1))
        t_custom = common.best_of(custom, repeat)
    return {
        "date": common.now_iso(), "host": common.host_info(),
        "params": {"lines": lines, "bytes": size, "repeat": repeat},
        "plain_loop_s": t_plain, "tail_s": t_tail, "parsers_s": t_parsers, "parse_s": t_parse, "pipeline_s": t_full, "samples": samples[0],
        "parse_lines_per_s": lines / t_parse, "pipeline_lines_per_s": lines / t_full,
        # the series state and rules alone: the whole pipeline's time less the reader's
        "pipeline_part_lines_per_s": lines / max(t_full - t_parse, 1e-9),
        "custom_s": t_custom, "custom_samples": custom_samples[0], "custom_lines_per_s": lines / t_custom,
        "parse_mb_per_s": size / t_parse / 1e6,
        "ratios": {"parse_to_plain": t_parse / t_plain, "tail_to_plain": t_tail / t_plain,
                   "goal_lines_per_s": GOAL_LINES_PER_S / (lines / t_parse),
                   "goal_pipeline_lines_per_s": GOAL_PIPELINE_LINES_PER_S / (lines / t_full),
                   "min_pipeline_lines_per_s": MIN_PIPELINE_LINES_PER_S / (lines / t_full)},
    }


def report(res: dict[str, Any]) -> str:
    p, r = res["params"], res["ratios"]
    return "\n".join([
        f"parse: {p['lines']} Megatron-format lines, {p['bytes'] / 1e6:.0f} MB, best of {p['repeat']}",
        f"  plain line loop {res['plain_loop_s']:.3f} s; tailer alone {res['tail_s']:.3f} s"
        f" ({r['tail_to_plain']:.1f}x); reader+parsers {res['parse_s']:.3f} s "
        f"({res['parse_lines_per_s']:,.0f} lines/s, {res['parse_mb_per_s']:.1f} MB/s, {res['samples']} samples)",
        f"  of which tailer + parsers (no samples) {res['parsers_s']:.3f} s, samples and copy filter"
        f" {res['parse_s'] - res['parsers_s']:.3f} s",
        f"  with series state and shipped rules: {res['pipeline_s']:.3f} s ({res['pipeline_lines_per_s']:,.0f} lines/s;"
        f" series state and rules alone {res['pipeline_s'] - res['parse_s']:.3f} s,"
        f" {res['pipeline_part_lines_per_s']:,.0f} lines/s)",
        f"  read as format: custom (a user pattern on RE2): {res['custom_s']:.3f} s "
        f"({res['custom_lines_per_s']:,.0f} lines/s, {res['custom_samples']} samples)",
        f"  reader vs goal >= {GOAL_LINES_PER_S:,} lines/s: ratio goal/measured {r['goal_lines_per_s']:.2f}"
        f" ({'within goal' if r['goal_lines_per_s'] <= 1 else 'BELOW GOAL'})",
        f"  pipeline vs goal >= {GOAL_PIPELINE_LINES_PER_S:,} lines/s: ratio goal/measured "
        f"{r['goal_pipeline_lines_per_s']:.2f} ({'within goal' if r['goal_pipeline_lines_per_s'] <= 1 else 'BELOW GOAL'});"
        f" vs >= {MIN_PIPELINE_LINES_PER_S:,} at the least: {r['min_pipeline_lines_per_s']:.2f}"
        f" ({'met' if r['min_pipeline_lines_per_s'] <= 1 else 'NOT MET'})",
        f"  time vs plain loop: {r['parse_to_plain']:.1f}x (for reference)",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=int, default=None, help="log lines (default 500000, quick 20000)")
    p.add_argument("--repeat", type=int, default=None, help="best of N (default 3, quick 1)")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return run(lines=args.lines or (20_000 if q else 500_000), repeat=args.repeat or (1 if q else 3))


def main(argv: list[str] | None = None) -> int:
    return common.bench_main(sys.modules[__name__], "parse", argv)


if __name__ == "__main__":
    raise SystemExit(main())
