"""The trainers canary (bench/trainers.py) in CI: the newest transformers, Lightning and DeepSpeed
releases, installed in cached venvs with CPU torch, train a tiny model with and without a planted
NaN; every source they write must page at the planted step (replay and the real daemon), no
healthy run may page. When a release changes its output, this fails before users notice.

It downloads (the venvs are cached per version under ~/.cache/precision-agent/trainers/) and
trains 15 runs (minutes): it runs where ``CI=true`` or ``PRECISION_AGENT_TRAINERS_CANARY=1``, and
is skipped otherwise (``python -m bench.trainers`` runs it by hand).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is a top-level package of the repo, not installed
    sys.path.insert(0, str(ROOT))

from bench import trainers  # noqa: E402

@pytest.mark.skipif(os.environ.get("CI") != "true" and os.environ.get("PRECISION_AGENT_TRAINERS_CANARY") != "1",
                    reason="downloads and trains: runs in CI or with PRECISION_AGENT_TRAINERS_CANARY=1")
def test_trainers_canary(tmp_path, capsys):
    rc = trainers.main(["--root", str(tmp_path / "runs"), "--results-dir", str(tmp_path)])
    res = json.loads((tmp_path / "trainers.json").read_text())
    table = capsys.readouterr().out
    assert res["rows"], table
    trained = {r["trainer"].split("-")[0] for r in res["rows"]}
    assert {"transformers", "lightning"} <= trained, table  # DeepSpeed only where it installs and runs
    failed = [r for r in res["rows"] if not r["ok"]]
    assert not failed and rc == 0, table
