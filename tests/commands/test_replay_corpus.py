"""`replay --json` on the real Megatron and DeepSpeed logs of ../shared/corpus/logs agrees with
INDEX.md: loss-scale first/min/last, observed decreases, overflow steps, no NaN where none."""

import json
import subprocess
import sys

import pytest

from conftest import corpus_path
from support.commands import replay_json

# file: (first, min, last, decreases, overflow_steps) as stated in corpus/logs/INDEX.md
EXPECTED = {
    "megatron_1.log": (8388608.0, 131072.0, 131072.0, 2, 16),
    "megatron_2.log": (8388608.0, 262144.0, 262144.0, 1, 15),
    # the counter stays 0 (pipeline engine), but 65536 -> 8192 -> 4096 are 3 + 1 back-offs, each an overflow
    "megatron_3.log": (32768.0, 4096.0, 4096.0, 2, 4),
    "megatron_4.log": (2048.0, 2048.0, 2048.0, 0, 0),
    "megatron_5.log": (4096.0, 4096.0, 4096.0, 0, 0),
    "megatron_6.log": (65536.0, 65536.0, 65536.0, 0, 0),
    "deepspeed_1.log": (4294967296.0, 1024.0, 1024.0, 22, 23),
    "deepspeed_2.log": (4294967296.0, 32768.0, 32768.0, 17, 17),
    "deepspeed_4.log": (16384.0, 8192.0, 8192.0, 2, 3),
    "deepspeed_5.log": (8192.0, 4096.0, 4096.0, 4, 4),
}


@pytest.mark.corpus
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_replay_matches_index(name):
    path = corpus_path("logs", name)
    r = replay_json(path)
    first, low, last, decreases, overflow = EXPECTED[name]
    assert r["format"] == name.split("_")[0]
    assert r["loss_scale"]["first"] == first
    assert r["loss_scale"]["min"] == low
    assert r["loss_scale"]["last"] == last
    assert r["loss_scale"]["decreases"] == decreases
    assert r["overflow_steps"] == overflow
    assert r["nonfinite"] == []  # e.g. Megatron's "number of nan iterations: 0" is no NaN
    assert not [f for f in r["findings"] if f["kind"] == "nonfinite"]


@pytest.mark.corpus
def test_deepspeed_5_increases_and_steps():
    r = replay_json(corpus_path("logs", "deepspeed_5.log"))
    assert r["loss_scale"]["increases"] == 3
    assert r["steps"] == {"first": 13437, "last": 93732}


def test_replay_report_and_contract_on_generated_log(tmp_path):
    """Runs without ../shared: a generated Megatron log with a collapse and a NaN grad norm."""
    from precision_agent.commands.demo import simulated_job
    log = tmp_path / "train.log"
    simulated_job(log, iterations=45, pause=0)
    r = replay_json(log)
    assert set(r) == {"file", "format", "lines", "records", "unrecognized", "steps", "loss_scale", "overflow_steps",
                      "nonfinite", "spikes", "findings", "precision", "loss_scaling", "finished", "attempts"}
    assert r["unrecognized"] is None and r["lines"] >= r["records"] > 0
    assert r["format"] == "megatron" and r["steps"] == {"first": 1, "last": 45}
    assert r["loss_scale"]["first"] == 65536.0 and r["loss_scale"]["min"] == 1.0
    assert r["loss_scale"]["decreases"] == 16 and r["overflow_steps"] == 16
    assert r["nonfinite"][0] == {"metric": "grad_norm", "step": 40, "line": 41}
    rules = {f["rule"] for f in r["findings"]}
    assert rules == {"LossScaleAtFloor", "LossScaleCollapse", "TrainingNonFinite"}
    floor = next(f for f in r["findings"] if f["rule"] == "LossScaleAtFloor")
    assert floor["severity"] == "page" and floor["step"] == 27 and floor["line"] == 28
    text = subprocess.run([sys.executable, "-m", "precision_agent", "replay", str(log)], capture_output=True,
                          text=True, timeout=60).stdout
    assert "first 65536, min 1, last 1; 16 decrease(s)" in text and "LossScaleAtFloor" in text


def test_replay_of_an_unrecognised_file_says_so_and_exits_2(tmp_path):
    """A log no parser recognises is no clean replay: stderr names the problem and the file's last
    lines, the exit status is 2 (README's exit-status table), the JSON still comes on stdout."""
    log = tmp_path / "train.log"
    log.write_text("".join(f"\x1b[32mworker {i}\x1b[0m: prefetching shard {i}\n" for i in range(300)))
    for args in ([], ["--json"]):
        r = subprocess.run([sys.executable, "-m", "precision_agent", "replay", str(log), *args], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "no training record recognised in 300 line(s)" in r.stderr and str(log) in r.stderr
        assert "worker 299: prefetching shard 299" in r.stderr and "\x1b" not in r.stderr
    out = json.loads(r.stdout)
    assert out["records"] == 0 and out["lines"] == 300
    assert out["unrecognized"]["sample"][-1] == "worker 299: prefetching shard 299"
    assert len(out["unrecognized"]["sample"]) == 5
    empty = tmp_path / "empty.log"
    empty.touch()
    r = subprocess.run([sys.executable, "-m", "precision_agent", "replay", str(empty)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "an empty file" in r.stderr
    # a recognised log is still a clean replay
    good = tmp_path / "good.log"
    good.write_text("".join(f" iteration {i:>8}/    1000 | lm loss: 4.2E+00 | loss scale: 65536.0 | grad norm: 1.5 |\n"
                            for i in range(1, 20)))
    r = subprocess.run([sys.executable, "-m", "precision_agent", "replay", str(good)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "blind" not in r.stderr, r.stderr
