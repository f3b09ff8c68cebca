"""Megatron and DeepSpeed line parsers, including the decoys real logs contain."""

import math

from precision_agent.model import (EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE,
                                   OVERFLOW, SKIPPED_CUMULATIVE, SKIPPED_INTERVAL)
from precision_agent.readers.parsers import Block, CompositeParser
from precision_agent.readers.parsers.base import to_float

MEGATRON = (" [2025-06-11 04:30:49] iteration       40/  300000 | consumed samples:        15360 | elapsed time per "
            "iteration (ms): 9512.6 | learning rate: 4.651163E-07 | global batch size:   384 | lm loss: 1.091734E+01 |"
            " loss scale: 131072.0 | grad norm: 38.652 | number of skipped iterations:   6 | number of nan iterations:   0 |")


def parse(text: str, fmt: str = "auto"):
    p = CompositeParser(fmt)
    return p, p.parse(Block(text, 1))


def values(rec):
    return {m: v for m, v, _ in rec.values}


def test_megatron_full_line():
    p, recs = parse(MEGATRON + "\n")
    assert p.format == "megatron"
    (r,) = recs
    v = values(r)
    assert r.step == 40 and r.line == 1
    assert v[LOSS] == 10.91734 and v[LOSS_SCALE] == 131072.0 and v[GRAD_NORM] == 38.652
    assert v[LEARNING_RATE] == 4.651163e-07 and v[SKIPPED_INTERVAL] == 6
    assert NONFINITE_MESSAGE not in v  # "number of nan iterations: 0" is a counter, not a NaN
    assert r.log_time is not None


def test_megatron_interval_without_loss_and_nan_grad_norm():
    skipped = (" iteration       20/  300000 | consumed samples:         7680 | learning rate: 0.000000E+00 | "
               "global batch size:   384 | loss scale: 4194304.0 | number of skipped iterations:  20 | "
               "number of nan iterations:   0 |")
    nan = (" iteration     7193/  320000 | consumed samples:       115088 | learning rate: 1.998E-04 | global batch "
           "size:    16 | loss scale: 1.0 | grad norm: nan | actual seqlen:  4096 | number of skipped iterations:   0"
           " | number of nan iterations:   3 |")
    _, recs = parse(f"noise\n{skipped}\n{nan}\n")
    a, b = recs
    assert (a.line, b.line) == (2, 3)
    assert LOSS not in values(a) and values(a)[SKIPPED_INTERVAL] == 20
    assert math.isnan(values(b)[GRAD_NORM]) and values(b)[LOSS_SCALE] == 1.0
    assert values(b)[NONFINITE_MESSAGE] == 3


def test_megatron_validation_is_eval_loss():
    _, recs = parse(" validation loss at iteration 12000 | lm loss value: 6.482917E+00 | lm loss PPL: 6.538755E+02 |\n")
    (r,) = recs
    assert values(r) == {EVAL_LOSS: 6.482917} and r.step == 12000


def test_megatron_rank_prefix_and_ansi_free():
    _, recs = parse("[rank3]:" + MEGATRON + "\n")
    assert recs[0].rank == "3"


def test_deepspeed_zero_reduce_and_hysteresis():
    text = ("[2025-03-02 17:41:09,518] [INFO] [loss_scaler.py:186:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping"
            " step. Attempted loss scale: 1048576, but hysteresis is 3. Reducing hysteresis to 2\n"
            "[2025-03-02 17:41:09,563] [INFO] [loss_scaler.py:179:update_scale] [deepscale] OVERFLOW! Rank 0 Skipping"
            " step. Attempted loss scale: 1048576, reducing to 524288\n")
    p, (h, r) = parse(text)
    assert p.format == "deepspeed"
    assert [m for m, _, _ in h.values] == [OVERFLOW, LOSS_SCALE]
    assert dict(h.values[0][2])["variant"] == "hysteresis" and h.values[1][1] == 1048576
    assert r.values[1][1] == 524288 and dict(r.values[1][2])["frm"] == 1048576
    assert abs(r.log_time - h.log_time - 0.045) < 1e-6


def test_deepspeed_glued_after_tqdm_and_split_record():
    text = ("Steps:   0%|▋       | 12/2400 [00:29<1:16:48,  1.93s/it, lr=0.0002, step_loss=nan]"
            "[2025-01-21 06:37:14,082] [INFO] \n"
            "[loss_scaler.py:179:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 64,"
            " reducing to 32\n")
    _, recs = parse(text)
    (r,) = [r for r in recs if r.producer == "deepspeed"]  # the bar's step_loss=nan is a user print
    assert r.line == 2 and r.values[1][1] == 32.0


def test_deepspeed_unfused_and_decoy():
    text = ("[2024-04-18 22:15:03,377] [INFO] [unfused_optimizer.py:214:step] [deepspeed] fp16 dynamic loss scale "
            "overflow! Skipping step. Attempted loss scale: 32768.0, reducing to 16384.0\n"
            "[2024-04-18 22:15:03,377] [INFO] [unfused_optimizer.py:288:_update_scale] Grad overflow on iteration: 20651\n"
            "[2024-04-18 22:15:09,842] [INFO] [unfused_optimizer.py:296:_update_scale] No Grad overflow for 1000 iterations\n"
            "[2024-04-18 22:15:09,842] [INFO] [unfused_optimizer.py:297:_update_scale] Increasing dynamic loss scale "
            "from 16384.0 to 32768.0\n"
            "[2024-11-06 09:02:47,915] [INFO] [logging.py:128:log_dist] [Rank 0] step=30, skipped=7, lr=[0.0003], "
            "mom=[(0.85, 0.95)]\n")
    _, recs = parse(text)
    assert [r.line for r in recs] == [1, 2, 4, 5]  # line 3 ("No Grad overflow") is not an event
    assert recs[1].step == 20651 and recs[1].values[0][0] == OVERFLOW
    assert recs[2].values == [(LOSS_SCALE, 32768.0, (("frm", 16384.0),))]
    assert recs[3].step == 30 and values(recs[3]) == {SKIPPED_CUMULATIVE: 7.0, LEARNING_RATE: 0.0003}


def test_forced_format_only_uses_that_parser():
    _, recs = parse(MEGATRON + "\n[x] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4, "
                    "reducing to 2\n", fmt="deepspeed")
    assert [r.producer for r in recs] == ["deepspeed"]


def test_to_float_spellings():
    assert math.isnan(to_float("nan")) and math.isnan(to_float("nan.0")) and math.isnan(to_float("NaN"))
    assert to_float("inf") == math.inf and to_float("-inf") == -math.inf
    assert to_float("1.091734E+01") == 10.91734 and to_float("7.450580596923828e-09") == 7.450580596923828e-09
    assert to_float("garbage") is None


def test_fast_source_positions_are_true_source_positions():
    import dataclasses

    import pytest

    from precision_agent.model import SourcePos, source_pos
    a, b = source_pos("x.log", 3), SourcePos("x.log", 3)
    assert type(a) is SourcePos and a == b and hash(a) == hash(b) and dataclasses.asdict(a) == dataclasses.asdict(b)
    assert source_pos("x.log", 3, 7) == SourcePos("x.log", 3, 7) != a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.line = 4  # type: ignore[misc]
