"""Replay one fuzz case in this process: ``python tests/fuzzing/replay.py TARGET INDEX [--seed N]
[--profile] [--show]`` (the seed defaults to $PRECISION_AGENT_FUZZ_SEED or the suite's default)."""

from __future__ import annotations

import argparse
import cProfile
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuzzing.core import case_rng, seed_from_env  # noqa: E402
from fuzzing.targets import TARGETS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import faulthandler
    faulthandler.dump_traceback_later(8, exit=True)  # a hang shows where it is
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("target", choices=sorted(TARGETS))
    p.add_argument("index", type=int)
    p.add_argument("--seed", type=int, default=seed_from_env())
    p.add_argument("--profile", action="store_true")
    p.add_argument("--show", action="store_true", help="print the input (repr)")
    args = p.parse_args(argv)
    t = TARGETS[args.target]
    payload = t.make(case_rng(args.seed, t.name, args.index))
    if args.show:
        print(repr(payload))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        try:
            if args.profile:
                cProfile.runctx("t.run(payload, Path(d))", globals(), locals(), sort="cumtime")
            else:
                t.run(payload, Path(d))
        except t.allowed as exc:
            print(f"documented error: {type(exc).__name__}: {exc}")
        print(f"{args.target} seed={args.seed} case={args.index}: {time.perf_counter() - t0:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
