"""Parsers for HF Trainer, Lightning, apex/torch_npu, nanoGPT, torchtitan, detectron2, mmengine/mmcv,
DLLogger and TF Estimator: synthetic lines for each trap, and `replay --json` on the real corpus
logs of these producers checked against corpus/logs/INDEX.md."""

import math
from pathlib import Path

import pytest

from conftest import corpus_path
from precision_agent.model import (EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE,
                                   OVERFLOW)
from precision_agent.readers.parsers import Block, CompositeParser
from precision_agent.readers.parsers.apex import ApexParser
from precision_agent.readers.parsers.detectron2 import Detectron2Parser
from precision_agent.readers.parsers.dllogger import DLLoggerParser
from precision_agent.readers.parsers.hf_trainer import HFTrainerParser
from precision_agent.readers.parsers.lightning import LightningParser
from precision_agent.readers.parsers.mmengine import MMEngineParser
from precision_agent.readers.parsers.nanogpt import NanoGPTParser
from precision_agent.readers.parsers.tf_estimator import TFEstimatorParser
from precision_agent.readers.parsers.torchtitan import TorchtitanParser
from support.commands import replay_json

BAR = "    65%|██████▍   | 771/1188 [06:41<00:56,  7.41it/s]"


def run(parser_cls, text, first_line=1):
    """Records from the parser alone, checked to be the same ones CompositeParser('auto') keeps."""
    recs = parser_cls().parse(Block(text, first_line))
    auto = CompositeParser()
    merged = [r for r in auto.parse(Block(text, first_line)) if r.producer != "hints"]  # run-wide facts apart
    key = lambda rs: [(r.producer, r.line, r.step, repr(r.values)) for r in rs]  # repr: nan == nan
    assert key(merged) == key(recs)
    if recs:
        assert auto.format == parser_cls.name
    return recs


def vals(rec):
    return {m: v for m, v, _ in rec.values}


def attrs(rec, metric):
    return next(dict(a) for m, _, a in rec.values if m == metric)


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


# -- HF Trainer ------------------------------------------------------------------------------------------
def test_hf_dict_values_nan_inf_and_zero_loss():
    text = ("{'loss': 0.2318, 'grad_norm': 0.05217730849981308, 'learning_rate': 0.0001666666666666667, 'epoch': 0.41}\n"
            "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 0.00012372881355932205, 'epoch': 2.18}\n"
            "{'loss': 0.1342, 'grad_norm': inf, 'learning_rate': 3.571428571428572e-05, 'epoch': 0.63}\n")
    a, b, c = run(HFTrainerParser, text)
    assert vals(a) == {LOSS: 0.2318, GRAD_NORM: 0.05217730849981308, LEARNING_RATE: 0.0001666666666666667}
    assert (a.line, b.line, c.line) == (1, 2, 3) and a.step is None
    assert vals(b)[LOSS] == 0.0 and math.isnan(vals(b)[GRAD_NORM])
    assert vals(c)[GRAD_NORM] == math.inf and vals(c)[LEARNING_RATE] == 3.571428571428572e-05


def test_hf_step_wrapper_llamafactory_prefix_quote_rank_and_padding():
    text = ("noise\n"
            "Step:      7 {'loss': 3.1057, 'grad_norm': inf, 'learning_rate': 1.4e-05, 'epoch': 0.0327}\n"
            "[INFO|2025-01-02 10:00:00] llamafactory.train.callbacks:158 >> {'loss': 2.0431, 'learning_rate': "
            "4.9e-05, 'epoch': 0.02, 'throughput': 1234.56}\n"
            "> {'loss': 1.5, 'grad_norm': 0.7, 'learning_rate': 1e-05, 'epoch': 0.1}" + " " * 120 + "\n"
            "[rank1]:{'loss': 1.25, 'learning_rate': 2e-05, 'epoch': 0.2}\n")
    a, b, c, d = run(HFTrainerParser, text, first_line=10)
    assert (a.line, a.step, vals(a)[LOSS], vals(a)[GRAD_NORM]) == (11, 7, 3.1057, math.inf)
    assert (b.line, vals(b)) == (12, {LOSS: 2.0431, LEARNING_RATE: 4.9e-05})
    assert b.log_time is not None
    assert (c.line, vals(c)) == (13, {LOSS: 1.5, GRAD_NORM: 0.7, LEARNING_RATE: 1e-05})
    assert (d.line, d.rank, vals(d)[LOSS]) == (14, "1", 1.25)


def test_hf_glued_after_tqdm_and_cr_frames():
    text = (BAR + "{'loss': 0.9163818359375, 'learning_rate': 1.7550505050505052e-05, 'epoch': 0.648989898989899}\n"
            "\r 10%|█  | 1/10 [00:01<00:09, 1.0it/s]\r 20%|██ | 2/10 [00:02<00:08, 1.0it/s]"
            "{'loss': 0.5, 'learning_rate': 1e-05, 'epoch': 0.2}\r 30%|███| 3/10 [00:03<00:07, 1.0it/s]\n")
    a, b = run(HFTrainerParser, text)
    assert (a.line, vals(a)) == (1, {LOSS: 0.9163818359375, LEARNING_RATE: 1.7550505050505052e-05})
    assert (b.line, vals(b)) == (2, {LOSS: 0.5, LEARNING_RATE: 1e-05})


def test_hf_fragments_summary_and_eval_dicts():
    text = (BAR + "7894737e-05, 'epoch': 0.4437869822485207}\n"                     # overwritten opening
            + BAR + "94736842106e-06, 'loss': 0.5, 'epoch': 0.89}\n"                 # even with a key in it
            "{'train_runtime': 312.4662, 'train_samples_per_second': 705.9, 'train_loss': 0.1796, 'epoch': 8.0}\n"
            "{'eval_loss': 2.3665096759796143, 'eval_runtime': 60.4, 'eval_samples_per_second': 672.4, 'epoch': 0.26}\n"
            "     {'eval_loss': 0.6999529004096985, 'eval_accuracy': 0.70, 'eval_recall_macro': 0.100%|███▉ | 1/2\n"
            "{'loss': 0.7, 'learning_rate': 1.5e-05\n")                                # cut: last value unsure
    recs = run(HFTrainerParser, text)
    assert [(r.line, vals(r)) for r in recs] == [(4, {EVAL_LOSS: 2.3665096759796143}),
                                                 (5, {EVAL_LOSS: 0.6999529004096985}),
                                                 (6, {LOSS: 0.7})]


def test_hf_ignores_json_and_unrelated_dicts():
    text = ('2022-10-19 03:48:21 | INFO | train_inner | {"epoch": 2, "loss": "21.43", "lr": "9e-05"}\n'
            "config: {'model': 'bert', 'lr': 0.1}\n")
    assert HFTrainerParser().parse(Block(text, 1)) == []


# -- apex / torch_npu ------------------------------------------------------------------------------------
def test_apex_overflow_glued_after_tqdm_and_small_scales():
    text = (BAR.replace("771", "774") + "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 16384.0\n"
            "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 0.125\n"
            "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 8.095e-320\n")
    a, b, c = run(ApexParser, text)
    assert a.line == 1 and a.values == [(OVERFLOW, 1.0, (("variant", "reduce"), ("to", 16384.0))),
                                        (LOSS_SCALE, 16384.0, (("decrease", True),))]
    assert vals(b)[LOSS_SCALE] == 0.125 and attrs(b, OVERFLOW)["to"] == 0.125
    assert vals(c)[LOSS_SCALE] == 8.095e-320 and c.line == 3


def test_apex_decoys():
    text = ("loss_scale             : dynamic\n"
            "Warning: NaN or Inf found in input tensor.\n"
            "[deepspeed] No Grad overflow for 1000 iterations\n")
    recs = CompositeParser().parse(Block(text, 1))
    # the banner line says the run uses apex's dynamic scaler (a hint), never a value
    assert [r for r in recs if r.producer != "hints"] == []
    assert [dict(r.values[0][2])["scaler"] for r in recs] == ["dynamic"]


def test_torch_npu_two_messages_one_overflow_per_line():
    text = ("Gradient overflow. Skipping stepGradient overflow. Skipping stepGradient overflow. Skipping step\n"
            "Loss scaler reducing loss scale to 2048.0\n")
    a, b = run(ApexParser, text)
    assert (a.line, vals(a)) == (1, {OVERFLOW: 1.0})
    assert (b.line, b.values) == (2, [(LOSS_SCALE, 2048.0, (("decrease", True),))])


def test_torch_npu_rank_copies_count_once_in_replay(tmp_path):
    from precision_agent.commands.replay import replay
    from precision_agent.engine.rulefile import default_rules_dir, load_rules
    log = tmp_path / "npu.log"
    log.write_text("{'loss': 1.0, 'grad_norm': 1.0, 'learning_rate': 1e-05, 'epoch': 0.1}\n"
                   "Gradient overflow. Skipping stepGradient overflow. Skipping step\n"
                   "Gradient overflow. Skipping step\n"
                   "Loss scaler reducing loss scale to 32768.0\n"
                   "Loss scaler reducing loss scale to 32768.0\n"
                   "Loss scaler reducing loss scale to 32768.0\n"
                   "{'loss': 1.1, 'grad_norm': 1.2, 'learning_rate': 1e-05, 'epoch': 0.2}\n")
    r = replay(log, load_rules([default_rules_dir()]))
    assert r["overflow_steps"] == 1
    assert r["loss_scale"]["decreases"] == 1 and r["loss_scale"]["last"] == 32768.0
    assert r["nonfinite"] == []


# -- Lightning -------------------------------------------------------------------------------------------
def test_lightning_wrapped_bar_nan0():
    text = ("Epoch 1:  61%|████████████████████████████████████████████████████████████▌\n"
            "| 4117/6730 [03:18<02:05, 20.79it/s, v_num=3, learning_rate_step=0.0002, train_loss_step=nan.0\n")
    (r,) = run(LightningParser, text)
    assert r.line == 2 and r.step is None
    assert math.isnan(vals(r)[LOSS]) and vals(r)[LEARNING_RATE] == 0.0002


def test_lightning_cr_frames_and_keys():
    text = ("Epoch 0:  10%|█ | 10/100 [00:01<00:09, 9.9it/s, v_num=0, train_loss=2.5]"
            "\rEpoch 0:  20%|██| 20/100 [00:02<00:08, 9.9it/s, v_num=0, train_loss=2.25, train_loss_epoch=3.0, "
            "val_loss=9.0]\n")
    a, b = run(LightningParser, text)
    assert vals(a) == {LOSS: 2.5} and vals(b) == {LOSS: 2.25} and a.line == b.line == 1


def test_lightning_not_a_plain_tqdm_postfix():
    text = "Steps:   0%|▋  | 12/2400 [00:29<1:16:48,  1.93s/it, lr=0.0002, step_loss=nan]\n"
    assert LightningParser().parse(Block(text, 1)) == []


# -- nanoGPT ---------------------------------------------------------------------------------------------
def test_nanogpt_iter_and_eval_lines():
    text = ("> 2024-08-14 21:07:19 iter 4500: loss 3.9172, time 28841.06ms, mfu 11.62%\n"
            "> 2024-08-14 21:07:31 iter 4510: loss nan, time 1187.40ms, mfu 11.97%\n"
            "step 5000: train loss 3.8123, val loss 3.9541\n")
    a, b, c = run(NanoGPTParser, text)
    assert (a.line, a.step, vals(a)) == (1, 4500, {LOSS: 3.9172}) and a.log_time is not None
    assert b.step == 4510 and math.isnan(vals(b)[LOSS])
    assert (c.line, c.step, vals(c)) == (3, 5000, {LOSS: 3.8123, EVAL_LOSS: 3.9541})


# -- torchtitan ------------------------------------------------------------------------------------------
def test_torchtitan_lines_ansi_leftovers_and_sentinel():
    text = ("    [rank0]:2024-12-09 05:18:44,270 - root - INFO - Model llama2 13B [31msize: 13,015,864,320 total\n"
            "    [rank0]:2024-12-09 05:19:03,884 - root - INFO - step: 20  loss:  8.4157  mmemory: 61.27GiB(43.81%)"
            "  tps: 2,318  mfu: 38.64%\n"
            "[rank0]:[titan] 2025-10-07 12:41:26,395 - root - INFO - step: 35  loss:  2.98713  grad_norm:  0.5214"
            "  memory:  7.83GiB(53.79%)  tps: 5,906  tflops: 0.41  mfu: 0.13%\n"
            "[rank3]:[titan] 2026-01-14 07:26:11,542 - root - INFO - step:  2  loss: -1.0000  memory: 41.08GiB(51.92%)"
            "  tps: 6  tflops: 1.34  mfu: 0.43%\n"
            "[rank0]:[titan] 2025-10-07 12:41:27,000 - root - INFO - [31mstep: 36  [32mloss:  nan  [33mgrad_norm:"
            "  inf  [34mmemory:  7.83GiB\n")
    a, b, s, c = run(TorchtitanParser, text)
    assert (a.line, a.step, a.rank, vals(a)) == (2, 20, "0", {LOSS: 8.4157}) and a.log_time is not None
    assert (b.line, b.step, vals(b)) == (3, 35, {LOSS: 2.98713, GRAD_NORM: 0.5214})
    assert (s.line, s.step, s.rank, s.values) == (4, 2, "3", [])   # sentinel: claimed, no loss
    assert (c.line, c.step) == (5, 36) and math.isnan(vals(c)[LOSS]) and vals(c)[GRAD_NORM] == math.inf


def test_torchtitan_ignores_user_step_prints():
    assert TorchtitanParser().parse(Block("step:20, loss:2.783203125\ntimestep: 5  loss: 1.0\n", 1)) == []


# -- detectron2 ------------------------------------------------------------------------------------------
def test_detectron2_events_and_floating_point_error():
    text = ("[06/14 03:58:22 d2.utils.events]: eta: 3:27:16  iter: 519  total_loss: 1.382  loss_cls: 0.913  "
            "loss_box_reg: 0.441  time: 0.3108  data_time: 0.0047  lr: 0.005198  max_mem: 5216M\n"
            "FloatingPointError: Loss became infinite or NaN at iteration=4418!\n"
            "loss_dict = {'loss_cls': tensor(nan, device='cuda:1', grad_fn=<NllLossBackward>), 'loss_box_reg':"
            " tensor(nan, device='cuda:1', grad_fn=<DivBackward0>), 'loss_mask': tensor(843907.3125, device='cuda:1',\n")
    a, b = run(Detectron2Parser, text)
    assert (a.line, a.step, vals(a)) == (1, 519, {LOSS: 1.382, LEARNING_RATE: 0.005198})
    assert (b.line, b.step, b.values) == (2, 4418, [(NONFINITE_MESSAGE, 1.0, (("what", "loss"),))])


# -- mmengine / mmcv -------------------------------------------------------------------------------------
def test_mmengine_and_mmcv_lines():
    text = ("04/17 08:52:36 - mmengine - INFO - Epoch(train) [2][180/612]  base_lr: 1.0000e-03 lr: 1.4472e-04  "
            "eta: 3:10:05  time: 2.3417  data_time: 0.0051  memory: 13584  loss: 1.9346  grad_norm: nan\n"
            "2021-11-23 07:14:50,962 - mmdet - INFO - Epoch [3][412/915]\tlr: 2.500e-04, eta: 4:02:37, time: 0.518,"
            " data_time: 0.084, memory: 6291, loss_cls: nan, loss_bbox: nan, loss_centerness: nan, loss: nan\n"
            "[ INFO ] Epoch [3][412/915]\tlr: 2.500e-04, eta: 4:02:37, time: 0.518, data_time: 0.084, memory: 6291,"
            " loss_cls: nan, loss_bbox: nan, loss_centerness: nan, loss: nan\n"
            "04/17 09:00:00 - mmengine - INFO - Epoch(val) [2][50/100]  eta: 0:00:10  time: 0.1  data_time: 0.01\n"
            "04/17 09:00:01 - mmengine - INFO - Iter(train) [  50/80000]  lr: 1.0e-04  loss: 2.5000  "
            "decode.loss_ce: 2.5000\n")
    a, b, c, d = run(MMEngineParser, text)
    assert (a.line, a.step, vals(a)[LOSS], vals(a)[LEARNING_RATE]) == (1, 792, 1.9346, 1.4472e-04)
    assert math.isnan(vals(a)[GRAD_NORM])
    assert (b.line, b.step, vals(b)[LEARNING_RATE]) == (2, 2 * 915 + 412, 2.5e-04) and math.isnan(vals(b)[LOSS])
    assert b.log_time is not None and GRAD_NORM not in vals(b)
    assert (c.line, c.step) == (3, b.step) and math.isnan(vals(c)[LOSS])
    assert (d.line, d.step, vals(d)) == (5, 50, {LOSS: 2.5, LEARNING_RATE: 1.0e-04})


# -- DLLogger --------------------------------------------------------------------------------------------
def test_dllogger_training_and_parameter_lines():
    text = ("DLL 2021-02-15 23:05:19.482015 - Training Epoch: 1 Training Iteration: 2614  average_loss : "
            "2.807316541671753  step_loss : 2.669921875  learning_rate : 0.004127583912754059 \n"
            "DLL 2021-02-16 18:12:44.907126 - PARAMETER loss_scale : 7.450580596923828e-09 \n"
            "DLL 2021-02-16 18:12:44.907126 - PARAMETER model : bert_large \n"
            "DLL 2021-02-16 18:26:03.215587 - Training Epoch: 1 Training Iteration: 2700  step_loss : nan \n")
    a, b, c = run(DLLoggerParser, text)
    assert (a.line, a.step, vals(a)) == (1, 2614, {LOSS: 2.669921875, LEARNING_RATE: 0.004127583912754059})
    assert a.log_time is not None
    assert (b.line, b.step, b.values) == (2, None, [(LOSS_SCALE, 7.450580596923828e-09, ())])
    assert (c.line, c.step) == (4, 2700) and math.isnan(vals(c)[LOSS])


# -- TF Estimator ----------------------------------------------------------------------------------------
def test_tf_estimator_divergence_and_loss_lines():
    text = ("ERROR:tensorflow:Model diverged with loss = NaN.\n"
            "E1103 08:21:47.530912 139872204318528 basic_session_run_hooks.py:771] Model diverged with loss = NaN.\n"
            "INFO:tensorflow:loss = 0.6931472, step = 1\n"
            "I1103 08:21:47.530912 139872204318528 basic_session_run_hooks.py:262] loss = 2.25, step = 100 (12.3 sec)\n"
            "INFO:tensorflow:global_step/sec: 8.1\n"
            "INFO:tensorflow:Saving dict for global step 1000: accuracy = 0.9, global_step = 1000, loss = 0.25\n")
    a, b, c, d, e = run(TFEstimatorParser, text)
    for r, line in ((a, 1), (b, 2)):
        assert (r.line, r.step, r.values) == (line, None, [(NONFINITE_MESSAGE, 1.0, (("what", "loss"),))])
    assert (c.line, c.step, vals(c)) == (3, 1, {LOSS: 0.6931472})
    assert (d.line, d.step, vals(d)) == (4, 100, {LOSS: 2.25})
    assert (e.line, e.step, vals(e)) == (6, 1000, {EVAL_LOSS: 0.25})


# -- the real corpus through `replay --json` -------------------------------------------------------------


# file: (format, loss scale (first, min, last, decreases) or None, overflow steps,
#        non-finite (metric, count, first line) or None), as stated in corpus/logs/INDEX.md. A
#        non-finite grad norm beside a finite loss, where the run may scale its loss (HF Trainer
#        prints no scale), is a step the scaler skipped: one overflow event each (docs/rules.md)
CORPUS = {
    "hf_trainer_1.log": ("hf_trainer", None, 32, ("grad_norm", 32, 30)),
    "hf_trainer_2.log": ("hf_trainer", (32768.0, 8192.0, 8192.0, 3), 3, None),
    "hf_trainer_3.log": ("hf_trainer", None, 1, ("grad_norm", 1, 26)),
    "hf_trainer_4.log": ("hf_trainer", None, 1, ("grad_norm", 1, 7)),
    "hf_trainer_5.log": ("hf_trainer", None, 75, ("grad_norm", 75, 1)),
    "apex_1.log": ("apex", (32768.0, 0.25, 0.25, 18), 18, None),
    "torchtitan_1.log": ("torchtitan", None, 0, None),
}


@pytest.mark.corpus
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_replay_group_a_corpus(name):
    r = replay_json(corpus_path("logs", name))
    fmt, scale, overflow, nonfinite = CORPUS[name]
    assert r["format"] == fmt
    if scale is None:
        assert r["loss_scale"] is None
    else:
        ls = r["loss_scale"]
        assert (ls["first"], ls["min"], ls["last"], ls["decreases"]) == scale and ls["increases"] == 0
    assert r["overflow_steps"] == overflow
    if nonfinite is None:
        assert r["nonfinite"] == []
    else:
        metric, n, first = nonfinite
        assert r["nonfinite"][0]["line"] == first
        assert {e["metric"] for e in r["nonfinite"]} == {metric}
        assert len(r["nonfinite"]) == n


@pytest.mark.corpus
def test_hf_trainer_1_parser_reads_all_nan():
    text = Path(corpus_path("logs", "hf_trainer_1.log")).read_text(encoding="utf-8")
    recs = HFTrainerParser().parse(Block(text, 1))
    nan = [r.line for r in recs if math.isnan(vals(r).get(GRAD_NORM, 0.0))]
    assert len(nan) == 32 and nan[0] == 30
    assert all(vals(r)[LOSS] == 0.0 for r in recs if r.line in nan)   # 'loss': 0.0 is finite, not a NaN
    # the 6 end summaries ('train_loss') are not training losses
    assert not any(r.line in (28, 32, 38, 46, 57, 70) for r in recs)
    r = replay_json(corpus_path("logs", "hf_trainer_1.log"))
    assert r["nonfinite"][0]["line"] == 30 and {e["metric"] for e in r["nonfinite"]} == {"grad_norm"}


@pytest.mark.corpus
def test_hf_trainer_2_fragments_and_split_eval_dict():
    text = Path(corpus_path("logs", "hf_trainer_2.log")).read_text(encoding="utf-8")
    recs = CompositeParser().parse(Block(text, 1))
    hf = [r for r in recs if r.producer == "hf_trainer"]
    assert not any(r.line in (8, 72, 79) for r in recs)          # garbled fragments are skipped
    assert len([r for r in hf if LOSS in vals(r)]) == 80
    assert [vals(r) for r in hf if r.line == 87] == [{EVAL_LOSS: 0.6999529004096985}]
    assert [r.line for r in recs if r.producer == "apex"] == [38, 45, 49]


@pytest.mark.corpus
def test_hf_trainer_4_eval_dicts_and_5_steps():
    text = Path(corpus_path("logs", "hf_trainer_4.log")).read_text(encoding="utf-8")
    recs = HFTrainerParser().parse(Block(text, 1))
    assert [r.line for r in recs if EVAL_LOSS in vals(r)] == [13, 27]
    assert len([r for r in recs if LOSS in vals(r)]) == 11 and vals(recs[0])[LEARNING_RATE] == 0.0
    r = replay_json(corpus_path("logs", "hf_trainer_5.log"))
    assert r["steps"] == {"first": 3, "last": 299}
    assert r["nonfinite"][0] == {"metric": "grad_norm", "step": 3, "line": 1}


@pytest.mark.corpus
def test_torchtitan_1_steps_and_losses():
    text = Path(corpus_path("logs", "torchtitan_1.log")).read_text(encoding="utf-8")
    recs = [r for r in CompositeParser().parse(Block(text, 1)) if r.producer != "hints"]
    assert [r.step for r in recs] == [1] + list(range(10, 101, 10))
    assert vals(recs[0])[LOSS] == 12.2417 and vals(recs[-1])[LOSS] == 6.4719
    assert recs[1].line == 10 and vals(recs[1])[LOSS] == 9.8821          # the 'mmemory:' line
    assert all(r.rank == "0" for r in recs)
