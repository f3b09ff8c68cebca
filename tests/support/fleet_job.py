"""The simulated multi-host training job of tests/e2e/test_fleet.py, run as its own process.

    python fleet_job.py ROOT RUN HOSTS RANKS_PER_HOST FIRST LAST PAUSE [RANK=NAN_STEP ...]
    python fleet_job.py dump DIR STEP RANK OP

appends, step by step in lock-step over every rank (as a data-parallel job logs), one Megatron-LM
iteration line (bf16: loss scale 1.0) per step to ``ROOT/h<NN>/logs/<RUN>_rank<R>.log`` for the
global ranks R of host NN, from step FIRST to LAST (a step lower than the log's last one is a
restart from a checkpoint). ``R=S``: rank R's loss is NaN from step S on. (Its grad norm stays
finite: a real grad norm is all-reduced, the same on every rank at a step, and one rank's NaN grad
norm beside finite ones of the others is what the agents call a hardware suspect.)
SIGTERM ends it after the step being written. The second form writes one rank's msprobe dump of
a step (``DIR/step<STEP>/rank<RANK>/``) whose op OP turns finite inputs into a NaN output, as
msprobe dumps during the step, before the step's log line.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path


def line(step: int, nan: bool) -> str:
    loss = float("nan") if nan else 5.0 - step * 0.001
    grad = "1.500"
    return (f" iteration {step:>8}/    1000 | consumed samples: {step * 64:>12} | elapsed time per iteration (ms): "
            f"812.5 | learning rate: 1.000000E-04 | global batch size:    64 | lm loss: {loss:.6E} | "
            f"loss scale: 1.0 | grad norm: {grad} | number of skipped iterations:   0 | "
            f"number of nan iterations:   {int(nan)} |\n")


def main(argv: list[str]) -> None:
    root, run = Path(argv[0]), argv[1]
    hosts, per_host, first, last, pause = int(argv[2]), int(argv[3]), int(argv[4]), int(argv[5]), float(argv[6])
    nan_from = {int(k): int(v) for k, v in (a.split("=") for a in argv[7:])}
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    files = {}
    for h in range(hosts):
        logs = root / f"h{h:02d}" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for r in range(h * per_host, (h + 1) * per_host):
            files[r] = open(logs / f"{run}_rank{r}.log", "a", encoding="utf-8")
    try:
        for step in range(first, last + 1):
            for r, f in files.items():
                f.write(line(step, step >= nan_from.get(r, 1 << 30)))
                f.flush()
            if stop:
                break
            if pause and step < last:
                time.sleep(pause)
    finally:
        for f in files.values():
            f.close()


def dump(argv: list[str]) -> None:
    import numpy as np
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for the shared writers
    from support.dumps import write_msprobe
    root, step, rank, op = Path(argv[0]), int(argv[1]), argv[2], argv[3]
    x = np.ones((2, 3), np.float32)
    y = x @ x.T
    y[0, 1] = np.nan
    write_msprobe(root, [(op, {"input_args": [x, x.T.copy()], "output": [y]}),
                         ("Torch.relu.0.forward", {"input_args": [y], "output": [y]})], step=step, rank=f"rank{rank}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"]:
        dump(sys.argv[2:])
    else:
        main(sys.argv[1:])
