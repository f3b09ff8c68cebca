"""``python -m bench [--quick] [--only NAME ...] [--results-dir DIR]``: run the benches against the
real agent, print a readable report, write one JSON file per bench to bench/results/<name>.json.

Exit status: 0 when every bench ran (whatever the numbers say: goals are reported as ratios, not
enforced), 1 when a bench could not run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from . import BENCHES, EXTRA, common


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description="Benchmarks of the real precision-agent.")
    p.add_argument("--quick", action="store_true", help="small N and short windows (seconds, not minutes)")
    p.add_argument("--only", action="append", choices=BENCHES + EXTRA, metavar="NAME",
                   help=f"run only this bench (repeatable): {', '.join(BENCHES + EXTRA)} "
                        f"({', '.join(EXTRA)}: only when named)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help=f"where to write <name>.json (default {common.RESULTS_DIR})")
    args = p.parse_args(argv)

    failed = []
    for name in args.only or BENCHES:
        mod = importlib.import_module(f"{__package__}.{name}")
        sub = argparse.ArgumentParser(add_help=False)
        mod.add_arguments(sub)
        bench_args = sub.parse_args([])
        bench_args.quick = args.quick
        t0 = time.monotonic()
        print(f"--- {name}{' (quick)' if args.quick else ''} ...", flush=True)
        try:
            res = mod.run_from_args(bench_args)
        except Exception:
            traceback.print_exc()
            print(f"--- {name}: FAILED to run", flush=True)
            failed.append(name)
            continue
        path = common.write_result(name, res, args.results_dir)
        print(mod.report(res))
        print(f"--- {name}: {time.monotonic() - t0:.0f} s, written to {path}\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
