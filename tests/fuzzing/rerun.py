"""Megatron's rerun state machine messages (agent/readers/parsers/megatron_rerun.py): the real lines of
tests/fixtures/megatron_rerun/ mutated, and lines of their repeated fragments (the scan stays linear:
a bounded look around each keyword, a bounded number of messages per line)."""

from __future__ import annotations

import random
from pathlib import Path

from . import mutate
from .core import Target
from .logs import make_block, parsed_values, pick

FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron_rerun"
SEEDS = [ln for f in sorted(FIXTURES.glob("*.log")) + sorted(FIXTURES.glob("*.txt"))
         for ln in f.read_text().splitlines() if ln.strip()]
BAIT = ["Rank ", "3", ", node ", "gpu-node-a", ", device ", ", iteration #", "1235", ": ", "Unexpected result ",
        "tensor(nan, device='cuda:3')", " on rank ", " at iteration #", " invocation #1 ", "(message='", "')",
        "First rerun: unexpected result is not reproducible within the tolerance", "Possible transient error!",
        "Second rerun: unexpected result is reproducible on a different GPU", "Correct result (but possible "
        "Application error)", "jobID=", " rank=", " iteration=", " status=", "first_rerun_reproducible ",
        "RerunValidationStatus.", "9" * 30, ",", "\t"]
VERDICTS = {"detected", "transient", "reproducible_same_gpu", "persistent", "reproducible"}


def _make(rng: random.Random) -> tuple[str, str]:
    fmt = pick(rng, ["auto", "megatron", "kernel"])
    if rng.random() < 0.7:
        return make_block(rng, SEEDS), fmt
    line = "".join(pick(rng, BAIT) for _ in range(rng.randint(1, 6))) * rng.choice((10, 1000, 20000))
    return (pick(rng, SEEDS) + " " + line)[: mutate.TEXT_MAX * 2] + "\n", fmt


def _run(payload: tuple[str, str], work: Path) -> None:
    for rec, metric, a in parsed_values(*payload):
        if metric == "rerun_verdict" and (a.get("verdict") not in VERDICTS or len(str(a.get("message", ""))) > 200
                                          or (rec.step is not None and not 0 <= rec.step < 1 << 63)):
            raise AssertionError(f"bad rerun verdict {a!r} at step {rec.step!r}")


TARGETS = [Target("megatron_rerun_lines", _make, _run)]
