"""fairseq, MindSpore family, Ascend TF, user-print, JSON-lines and user-regex parsers: the traps
each producer's real logs hold, then `replay --json` on the real corpus files against INDEX.md."""

import math

import pytest

from conftest import corpus_path
from precision_agent.model import (EVAL_LOSS, GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE,
                                   OVERFLOW)
from precision_agent.readers.parsers import FORMATS, PARSERS, Block, CompositeParser
from precision_agent.readers.parsers.ascend_tf import AscendTFParser
from precision_agent.readers.parsers.custom import RegexParser
from precision_agent.readers.parsers.fairseq import FairseqParser
from precision_agent.readers.parsers.jsonl import JsonLinesParser
from precision_agent.readers.parsers.mindspore import MindSporeParser
from precision_agent.readers.parsers.user_print import UserPrintParser
from support.commands import replay_json


def run(parser, text):
    return parser.parse(Block(text, 1))


def composite(text):
    p = CompositeParser()
    return p, p.parse(Block(text, 1))


def vals(rec):
    return {m: v for m, v, _ in rec.values}


def attrs(rec, metric):
    return next(dict(a) for m, _, a in rec.values if m == metric)


# --- fairseq -----------------------------------------------------------------------------------
FS_JSON = ('2022-10-19 03:48:21 | INFO | train_inner | {"epoch": 2, "update": 1.004, "loss": "21.43", "ppl": '
           '"2.82535e+06", "wps": "211.7", "num_updates": "5", "lr": "9e-05", "gnorm": "87.614", "loss_scale": "4", '
           '"train_wall": "171", "wall": "352"}')
FS_NOTE = ("2022-10-19 03:46:58 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, "
           "setting loss scale to: 8.0")
FS_SIMPLE = ("| epoch 002:    300 / 1816 loss=12.907, ppl=7680.58, wps=38127, ups=0, wpb=193402.551, bsz=6120.418, "
             "num_updates=2110, lr=5.27418e-05, gnorm=2.764, clip=0.000, oom=0.000, loss_scale=0.031, wall=1478, "
             "train_wall=1302")
FS_PIPE = ("| epoch 014 | loss 7.108 | nll_loss 5.562 | ppl 47.24 | wps 142871 | ups 0.3 | wpb 412736 | bsz 13502 | "
           "num_updates 5376 | lr 0.000483219 | gnorm 0.427 | clip 0% | oom 0 | loss_scale 0.250 | wall 18734")


def test_fairseq_json_train_inner_string_values():
    p, (r,) = composite(f"noise\n{FS_JSON}\n")
    assert p.format == "fairseq" and r.producer == "fairseq"
    assert r.line == 2 and r.step == 5 and r.log_time is not None
    assert vals(r) == {LOSS: 21.43, GRAD_NORM: 87.614, LEARNING_RATE: 9e-05, LOSS_SCALE: 4.0}


def test_fairseq_overflow_notes_all_vintages():
    text = (f"{FS_NOTE}\n| WARNING: overflow detected, setting loss scale to: 0.03125\n"
            "> NOTE: overflow detected, setting loss scale to: 64.0\n")
    recs = run(FairseqParser(), text)
    assert [r.line for r in recs] == [1, 2, 3]
    for r, scale in zip(recs, (8.0, 0.03125, 64.0)):
        assert r.values == [(OVERFLOW, 1.0, (("variant", "reduce"), ("to", scale))),
                            (LOSS_SCALE, scale, (("decrease", True),))]


def test_fairseq_moe_overflow_keys_are_decoys():
    line = ('2022-10-18 04:39:17 | INFO | train_inner | {"epoch": 1, "loss": "21.229", "overflow_expert1": "18.806", '
            '"overflow_expert2": "58.825", "inner_loss": "20.918", "num_updates": "10", "loss_scale": "8"}\n')
    p, (r,) = composite(line)
    assert OVERFLOW not in vals(r) and vals(r)[LOSS] == 21.229 and r.step == 10


def test_fairseq_valid_and_train_summaries():
    text = ('2021-03-08 12:43:15 | INFO | valid | {"epoch": 1, "valid_loss": "17.953", "valid_ppl": "253807", '
            '"valid_num_updates": "10"}\n'
            '2021-03-08 12:43:15 | INFO | train | {"epoch": 1, "train_loss": "19.351", "train_num_updates": "10", '
            '"train_gnorm": "36.26", "train_loss_scale": "1"}\n')
    p, (v, t) = composite(text)
    assert vals(v) == {EVAL_LOSS: 17.953} and v.step == 10
    assert vals(t) == {LOSS_SCALE: 1.0} and t.step == 10  # the summary's average train_loss is skipped


def test_fairseq_damaged_json_and_nan_loss():
    text = ('2021 | INFO | train_inner | {"epoch": 1, "loss": "16.4", "num_updates": \n'
            '2021 | INFO | train_inner | {"epoch": 1, "loss": "nan", "num_updates": "7", "loss_scale": "0.0001"}\n')
    (r,) = run(FairseqParser(), text)
    assert r.line == 2 and math.isnan(vals(r)[LOSS]) and vals(r)[LOSS_SCALE] == 0.0001


def test_fairseq_simple_format_rounded_scale_is_matched_to_the_exact_one():
    (w, s) = run(FairseqParser(), f"| WARNING: overflow detected, setting loss scale to: 0.03125\n{FS_SIMPLE}\n")
    assert s.step == 2110 and vals(s)[LOSS] == 12.907 and vals(s)[GRAD_NORM] == 2.764
    assert vals(s)[LEARNING_RATE] == 5.27418e-05
    assert vals(s)[LOSS_SCALE] == 0.03125 and attrs(s, LOSS_SCALE) == {"printed": 0.031}
    (alone,) = run(FairseqParser(), FS_SIMPLE)  # no note before it: fairseq scales are powers of two
    assert vals(alone)[LOSS_SCALE] == 0.03125
    (odd,) = run(FairseqParser(), FS_SIMPLE.replace("loss_scale=0.031", "loss_scale=100.000"))
    assert vals(odd)[LOSS_SCALE] == 100.0 and attrs(odd, LOSS_SCALE) == {}
    (zero,) = run(FairseqParser(), FS_SIMPLE.replace("loss_scale=0.031", "loss_scale=0.000"))
    assert LOSS_SCALE not in vals(zero)  # 0.000 with nothing to match it to is no scale
    (n, j) = run(FairseqParser(), "NOTE: overflow detected, setting loss scale to: 0.03125\n| INFO | train_inner"
                                  ' | {"loss": "3.1", "num_updates": "9", "loss_scale": "0.0312"}\n')
    assert vals(j)[LOSS_SCALE] == 0.03125 and attrs(j, LOSS_SCALE) == {"printed": 0.0312}  # json's round=4


def test_fairseq_rounding_is_not_a_scale_change(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(f"{FS_SIMPLE.replace('loss_scale=0.031', 'loss_scale=0.062')}\n"
                   f"| WARNING: overflow detected, setting loss scale to: 0.03125\n{FS_SIMPLE}\n{FS_SIMPLE}\n")
    r = replay_json(log)
    assert r["format"] == "fairseq"
    assert r["loss_scale"] == {"first": 0.0625, "min": 0.03125, "last": 0.03125, "decreases": 1, "increases": 0}
    assert r["overflow_steps"] == 1


def test_fairseq_pipe_summary_and_valid():
    valid = "| epoch 014 | valid on 'valid' subset | loss 7.3 | nll_loss 5.7 | ppl 52.1 | num_updates 5376"
    p, (s, v) = composite(f"{FS_PIPE}\n{valid}\n")
    assert p.format == "fairseq"
    assert vals(s) == {LOSS_SCALE: 0.25} and s.step == 5376  # epoch summary: no LOSS
    assert vals(v) == {EVAL_LOSS: 7.3} and v.step == 5376


def test_fairseq_minimum_loss_scale_reached():
    (r,) = run(FairseqParser(), "FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably "
                                "exploding.\n")
    assert r.values == [(OVERFLOW, 1.0, (("variant", "min_scale"),)), (LOSS_SCALE, 0.0001, ())]


# --- MindSpore family ------------------------------------------------------------------------------
MF = ("[INFO] 2024-03-27 19:52:08,613 [/data/mindformers/core/callback/callback.py:318] print_output_info: "
      "Epoch:[  2/  3], step:[    8/  250], loss:[3.117/2.900], time:412093.561 ms, lr:[0.], overflow cond: {}, "
      "loss_scale: 134217730.0")


def test_mindspore_loss_monitor_tensor_reprs():
    text = ("epoch: 213 step: 4, loss is Tensor(shape=[], dtype=Float32, value= 1.207315)\n"
            "epoch: 3 step: 100, loss is Tensor(shape=[1], dtype=Float32, [ 1.0821701e+01])\n"
            "epoch: 1 step: 1875, loss is 0.07\n"
            "epoch: 9 step: 2, loss is Tensor(shape=[], dtype=Float32, value= nan)\n")
    p, recs = composite(text)
    assert p.format == "mindspore" and [r.producer for r in recs] == ["mindspore"] * 4
    assert [vals(r)[LOSS] for r in recs[:3]] == [1.207315, 10.821701, 0.07] and math.isnan(vals(recs[3])[LOSS])
    assert all(r.step is None for r in recs)  # LossMonitor's step is within the epoch


def test_mindspore_invalid_loss_messages():
    text = ("ValueError: epoch: 3 step: 17. Invalid loss, terminating training.\n"
            "ValueError: In epoch: 1 step: 5, loss is NAN or INF, training process cannot continue, "
            "terminating training.\n")
    recs = run(MindSporeParser(), text)
    assert [r.values for r in recs] == [[(NONFINITE_MESSAGE, 1.0, (("what", "loss"),))]] * 2


def test_mindspore_outputs_triples_new_and_old():
    new = ("epoch: 328, current epoch percent: 1.000, step: 150682, outputs are (Tensor(shape=[], dtype=Float32, "
           "value= 1.71943), Tensor(shape=[], dtype=Bool, value= False), Tensor(shape=[], dtype=Float32, value= 1024))")
    old = ("epoch: 1 step: 12, outputs are (Tensor(shape=[1], dtype=Float32, [ 1.0821701e+01]), "
           "Tensor(shape=[], dtype=Bool, True), Tensor(shape=[], dtype=Float32, 65536))")
    param = ("epoch: 1 step: 13, outputs are (Tensor(shape=[], dtype=Float32, value= 9.5), Tensor(shape=[], "
             "dtype=Bool, value= False), Parameter (name=scale_sense, shape=(), dtype=Float32, requires_grad=True))")
    p, (a, b, c) = composite(f"{new}\n{old}\n{param}\n")
    assert p.format == "mindspore"
    assert vals(a) == {LOSS: 1.71943, LOSS_SCALE: 1024.0} and a.step == 150682
    assert vals(b) == {LOSS: 10.821701, OVERFLOW: 1.0, LOSS_SCALE: 65536.0} and b.step == 12
    assert attrs(b, OVERFLOW) == {"variant": "flag"}
    assert vals(c) == {LOSS: 9.5}


def test_mindone_callback_lines():
    text = ("epoch: 1 step: 100, lr: 0.0001000, loss: 0.123456, loss scale: 65536.\n"
            "overflow detected in epoch 1 step 101.\n")
    (a, b) = run(MindSporeParser(), text)
    assert vals(a) == {LOSS: 0.123456, LEARNING_RATE: 0.0001, LOSS_SCALE: 65536.0}
    assert b.values == [(OVERFLOW, 1.0, (("variant", "flag"),))]


def test_mindformers_overflow_cond_and_current_loss():
    end = ("[INFO] 2024-03-27 19:53:14,027 [/data/callback.py:171] epoch_end: Per sink_size step time: 2617.404 ms, "
           "per step time: 327.176 ms, avg loss: 2.874")
    newer = ("{ Epoch:[  1/  2], step:[    1/ 6250], loss: 10.411, per_step_time: 1346ms, lr: 0.0, overflow cond: "
             "False, loss_scale: 1.0, global_norm: [1.3187582], train_throughput_per_npu: 2.068T")
    p, recs = composite(f"{MF.format('True')}\n{end}\n{MF.format('False')}\n{newer}\n")
    assert [r.line for r in recs] == [1, 3, 4]  # the epoch_end average is read by nobody
    t, f, n = recs
    assert vals(t) == {LOSS: 3.117, LEARNING_RATE: 0.0, OVERFLOW: 1.0, LOSS_SCALE: 134217730.0}
    assert t.step is None and t.log_time is not None
    assert OVERFLOW not in vals(f)  # "overflow cond: False" is not an overflow
    assert vals(n) == {LOSS: 10.411, LEARNING_RATE: 0.0, GRAD_NORM: 1.3187582, LOSS_SCALE: 1.0}


def test_mindyolo_overflow_not_skipped_and_epoch_line():
    text = ("2025-02-08 14:22:31,906 [WARNING] overflow, still update, loss scale adjust to 512.0\n"
            "2025-02-08 14:22:31,913 [INFO] Epoch 3/300, Step 450/2870, imgsize (960, 960), loss: 5391.0742, "
            "lbox: 3.8814, lcls: 5384.6205, dfl: 2.5723, cur_lr: 0.08859198606271777\n")
    p, (o, e) = composite(text)
    assert p.format == "mindspore"
    assert o.values == [(OVERFLOW, 1.0, (("variant", "not_skipped"),)), (LOSS_SCALE, 512.0, ())]
    assert vals(e) == {LOSS: 5391.0742, LEARNING_RATE: 0.08859198606271777} and e.step is None
    # a generic "Epoch a/b, Step c/d, loss:" print without imgsize is not claimed as mindyolo
    _, (g,) = composite("Epoch 3/10, Step 5/9, loss: 2.5\n")
    assert g.producer == "user_print" and vals(g) == {LOSS: 2.5}


# --- Ascend TF (npu_bridge) ---------------------------------------------------------------------------
def test_ascend_tf_hook_lines():
    text = ("Find overflow in this step, skip apply gradients, loss scale value=65536\n"
            "Apply gradients, loss scale value=32768\n")
    p, (a, b) = composite(text)
    assert p.format == "ascend_tf"
    assert a.values == [(OVERFLOW, 1.0, (("variant", "skip"),)), (LOSS_SCALE, 65536.0, ())]
    assert b.values == [(LOSS_SCALE, 32768.0, ())]


def test_ascend_tf_reduce_all_true_means_no_overflow():
    text = ("loss_scale is:  65536.0\noverflow_status_reduce_all: True\n"
            "loss_scale is :  [32768.]\noverflow_status_reduce_all: False\n")
    recs = run(AscendTFParser(), text)
    assert [(r.line, r.values) for r in recs] == [
        (1, [(LOSS_SCALE, 65536.0, ())]), (3, [(LOSS_SCALE, 32768.0, ())]),
        (4, [(OVERFLOW, 1.0, (("variant", "flag"),))])]


def test_precision_tool_callback_and_tf1_readme_print():
    text = ("PrecisionTool: Train steps 12, loss_scale=32768.000 / not_overflow_status=True\n"
            "PrecisionTool: Train steps 13, loss_scale=16384.000 / not_overflow_status=False\n"
            ">>> Current Loss Scale >>>  [65536.0]\n")
    (a, b, c) = run(AscendTFParser(), text)
    assert a.step == 12 and a.values == [(LOSS_SCALE, 32768.0, ())]
    assert b.step == 13 and vals(b) == {OVERFLOW: 1.0, LOSS_SCALE: 16384.0}
    assert c.values == [(LOSS_SCALE, 65536.0, ())]


def test_ascend_modelzoo_test_line_irregular_spacing():
    text = ("2022-05-15 09:48:53.112488: I /home/x/tf_adapter.dir/compiler_depend.ts:805] The model has been "
            "compiled on the Ascend AI processor, current graph id is: 1\n"
            "epoch:1  step: 0 , loss:  0.0681 ,  time: 113.6311  acc: 1.0000\n"
            "epoch:2  step: 15 , loss:  nan ,  time: 98.2045  acc: 0.9375\n")
    p, (a, b) = composite(text)
    assert p.format == "ascend_tf" and a.producer == b.producer == "ascend_tf"
    assert (a.line, a.step, vals(a)) == (2, 0, {LOSS: 0.0681})
    assert b.step == 15 and math.isnan(vals(b)[LOSS])


# --- user prints (generic fallback) ---------------------------------------------------------------------
def test_user_print_common_shapes():
    text = ("step:20, loss:2.783203125\n"
            "2023-07-24 13:21:33.260 | INFO     | __main__:log_dist:53 - [Rank 0] Loss: 10.8719\n"
            "[12,  1800] loss: 1.842\n"
            "Step 5 | loss 2.3 | lr 0.1\n"
            "    > 100%|██████████| 5/5 [00:01<00:00]step:3, loss:nan\n"
            "global_step=7 epoch 1 loss: tensor(2.3100, device='cuda:0', grad_fn=<NllLossBackward0>)\n"
            "Epoch 2 step 9 loss=1.5, lr=3e-4, grad_norm=0.7\n")
    p, recs = composite(text)
    assert p.format == "user_print" and [r.producer for r in recs] == ["user_print"] * 7
    assert [r.step for r in recs] == [20, None, None, 5, 3, 7, None]
    assert [vals(r)[LOSS] for r in recs if r.line != 5] == [2.783203125, 10.8719, 1.842, 2.3, 2.31, 1.5]
    assert math.isnan(vals(recs[4])[LOSS])
    assert recs[1].rank is None and recs[1].log_time is not None  # "[Rank 0]" is no stream rank prefix
    assert vals(recs[6]) == {LOSS: 1.5, LEARNING_RATE: 3e-4, GRAD_NORM: 0.7}


def test_user_print_eval_and_decoys():
    text = ("step 100: train loss 2.1, val loss 2.4\n"
            "val_loss: 0.5\n"
            "eval loss = 0.7\n"
            "per step time: 327.176 ms, avg loss: 2.874\n"
            "Attempted loss scale: 65536, reducing to 32768\n"
            "loss_scale=0.5 loss_cls: 0.3 nll_loss 5.5 LpLoss_error: 0.04\n"
            "loss scaler 0 reducing loss scale to 16384.0\n"
            "the loss improved by 5% (loss of 3 points)\n")
    recs = run(UserPrintParser(), text)
    assert [(r.line, r.step, vals(r)) for r in recs] == [
        (1, 100, {LOSS: 2.1, EVAL_LOSS: 2.4}), (2, None, {EVAL_LOSS: 0.5}), (3, None, {EVAL_LOSS: 0.7})]


def test_user_print_yields_to_specific_parsers():
    text = ("[2025-03-02 17:41:09,563] [INFO] [loss_scaler.py:179:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping"
            " step. Attempted loss scale: 1048576, reducing to 524288\n"
            "step:20, loss:2.783203125\n"
            + MF.format("False") + "\n")
    _, recs = composite(text)
    assert [(r.line, r.producer) for r in recs] == [(1, "deepspeed"), (2, "user_print"), (3, "mindspore")]


# --- JSON lines -------------------------------------------------------------------------------------------
def test_jsonl_records_and_spellings():
    text = ('{"step": 3, "loss": 2.1, "lr": 1e-4, "grad_norm": NaN, "loss_scale": "1024"}\n'
            '  {"global_step": "4", "train/loss": "nan", "eval_loss": 2.5, "scale": 512}  \n'
            '{"iteration": 5, "train_loss": 1.5, "gnorm": Infinity, "learning_rate": "3e-05"}\n')
    p, (a, b, c) = composite(text)
    assert p.format == "jsonl"
    assert a.step == 3 and vals(a)[LOSS] == 2.1 and vals(a)[LEARNING_RATE] == 1e-4
    assert math.isnan(vals(a)[GRAD_NORM]) and vals(a)[LOSS_SCALE] == 1024.0
    assert b.step == 4 and math.isnan(vals(b)[LOSS]) and vals(b)[EVAL_LOSS] == 2.5 and vals(b)[LOSS_SCALE] == 512
    assert c.step == 5 and vals(c) == {LOSS: 1.5, GRAD_NORM: math.inf, LEARNING_RATE: 3e-05}


def test_jsonl_skips_summaries_configs_and_non_json():
    text = ('{"train_runtime": 12.5, "train_loss": 0.5, "epoch": 3.0}\n'
            '{"lr": 0.001, "batch_size": 32}\n'
            '{"loss": true, "step": 2}\n'
            '{"loss": 2.0, "step": \n'
            '[1, 2, 3]\n'
            '{"lr": 0.001, "step": 9}\n')
    recs = run(JsonLinesParser(), text)
    assert [(r.line, r.step, vals(r)) for r in recs] == [(6, 9, {LEARNING_RATE: 0.001})]
    assert run(JsonLinesParser(), "{'loss': 0.2318, 'epoch': 0.41}\n") == []  # a Python dict repr is not JSON
    assert run(JsonLinesParser(), FS_JSON + "\n") == []  # a prefixed object is not a JSON line


# --- user-defined regex -------------------------------------------------------------------------------------
def test_regex_parser_reads_named_groups():
    p = RegexParser(r"it (?P<step>\d+) loss=(?P<loss>\S+) scale=(?P<loss_scale>\S+)(?P<overflow> SKIP)?")
    assert p.name == "custom" and p.wants("anything")
    recs = run(p, "junk\nit 7 loss=2.5 scale=1024\n[rank1]: it 8 loss=nan scale=512 SKIP\n")
    assert [(r.line, r.step, r.producer) for r in recs] == [(2, 7, "custom"), (3, 8, "custom")]
    assert vals(recs[0]) == {LOSS: 2.5, LOSS_SCALE: 1024.0}
    assert math.isnan(vals(recs[1])[LOSS]) and vals(recs[1])[OVERFLOW] == 1.0 and recs[1].rank == "1"
    q = RegexParser(r"(?P<nonfinite>diverged)|val=(?P<eval_loss>[\d.]+) gn=(?P<grad_norm>\S+) lr=(?P<lr>\S+)")
    a, b = run(q, "model diverged\nval=1.5 gn=0.3 lr=1e-3\n")
    assert a.values == [(NONFINITE_MESSAGE, 1.0, (("what", "loss"),))]
    assert vals(b) == {EVAL_LOSS: 1.5, GRAD_NORM: 0.3, LEARNING_RATE: 1e-3}


@pytest.mark.parametrize("pattern, message", [
    (r"loss=(?P<loss>", "invalid regex"),
    (r"loss=(\S+)", "no named group"),
    (r"step (?P<step>\d+)", "no named group"),
    (r"loss=(?P<loss>\S+) (?P<accuracy>\S+)", "unknown named group(s) accuracy"),
    (r"(?P<loss>\d*)", "matches an empty string"),
    ("", "empty"),
    (r"(?<=loss=)(?P<loss>\S+)", "lookahead and lookbehind are not supported"),   # RE2 syntax, as Prometheus
    (r"(?P<step>\d+) (?P=step) (?P<loss>\S+)", "backreferences are not supported"),
    (r"(?P<loss>\S+) (?P<loss>\S+)", "loss used twice"),
])
def test_regex_parser_rejects_bad_patterns(pattern, message):
    with pytest.raises(ValueError, match="custom log format") as err:
        RegexParser(pattern)
    assert message in str(err.value)


def test_regex_parser_is_linear_on_the_issue_23_line_and_keeps_lines_and_groups():
    """``(\\d+\\s?)+$`` on a line of 40 digits backtracked for hours in Python's re (the worker and the
    GIL held); on RE2 the block is read at once, with the records around it on their lines.
    Python's ``(?<name>...)`` spelling of a named group works too."""
    p = RegexParser(r"(?:loss=(?<loss>\S+)|(\d+\s?)+)$")
    text = "loss=2.5\n" + "1" * 40 + "x\n" + "é ü " * 50 + "\n" + "4" * 40 + "\n" + "[rank3]: loss=nan\n"
    recs = run(p, text)
    assert [(r.line, r.rank) for r in recs] == [(1, None), (5, "3")]   # line 4: digits, no value group
    assert vals(recs[0]) == {LOSS: 2.5} and math.isnan(vals(recs[1])[LOSS])


def test_regex_parser_is_not_a_registered_format():
    assert "custom" not in FORMATS and "" not in FORMATS and RegexParser not in PARSERS
    assert {"fairseq", "mindspore", "ascend_tf", "user_print", "jsonl"} <= set(FORMATS)


# --- the real corpus through `replay --json` ----------------------------------------------------------------


# file: format, (first, min, last, decreases) or None, overflow_steps, as stated in corpus/logs/INDEX.md
CORPUS = {
    "fairseq_1.log": ("fairseq", (4.0, 1.0, 1.0, 2), 2),
    "fairseq_2.log": ("fairseq", (4.0, 1.0, 1.0, 2), 2),
    "fairseq_5.log": ("fairseq", (64.0, 8.0, 8.0, 4), 4),  # the overflow_expert* keys are decoys
    "mindspore_1.log": ("mindspore", None, 0),
    # 2 'overflow cond: True' prints, and the 4 + 10 halvings between the prints are overflows too
    # (MindSpore halves on every overflow step): 1 before the first value, then 4 and 10
    "mindspore_4.log": ("mindspore", (268435460.0, 16384.0, 16384.0, 2), 15),
    "ascend_npu_3.log": ("ascend_tf", None, 0),
}


@pytest.mark.corpus
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_replay_group_b_corpus(name):
    fmt, scale, overflow = CORPUS[name]
    r = replay_json(corpus_path("logs", name))
    assert r["format"] == fmt
    if scale is None:
        assert r["loss_scale"] is None
    else:
        ls = r["loss_scale"]
        assert (ls["first"], ls["min"], ls["last"], ls["decreases"]) == scale
    assert r["overflow_steps"] == overflow
    assert r["nonfinite"] == []


@pytest.mark.corpus
def test_replay_corpus_steps_and_losses():
    assert replay_json(corpus_path("logs", "fairseq_1.log"))["steps"] == {"first": 1, "last": 10}
    assert replay_json(corpus_path("logs", "ascend_npu_3.log"))["steps"] == {"first": 0, "last": 9}
    assert replay_json(corpus_path("logs", "mindspore_1.log"))["records"] == 14  # 14 LossMonitor losses


# file: (decreases, increases, overflow_steps): DeepSpeed numbers must not move now that the
# user's loss prints in these files are read too
DEEPSPEED = {"deepspeed_1.log": (22, 0, 23), "deepspeed_2.log": (17, 0, 17), "deepspeed_4.log": (2, 1, 3),
             "deepspeed_5.log": (4, 3, 4)}
LOSS_PRINTS = {"deepspeed_1.log": 31, "deepspeed_2.log": 5, "deepspeed_4.log": 10, "deepspeed_5.log": 2}


def test_fallbacks_never_name_the_format():
    p = CompositeParser()
    p.parse(Block("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4, reducing to 2\n"
                  "step:1, loss:2.0\nstep:2, loss:2.0\n", 1))
    assert p.format == "deepspeed"


@pytest.mark.corpus
@pytest.mark.parametrize("name", sorted(DEEPSPEED))
def test_replay_deepspeed_with_user_loss_prints(name):
    path = corpus_path("logs", name)
    r = replay_json(path)
    decreases, increases, overflow = DEEPSPEED[name]
    assert (r["loss_scale"]["decreases"], r["loss_scale"]["increases"], r["overflow_steps"]) == (
        decreases, increases, overflow)
    loss_lines = [rec for rec in CompositeParser().parse(Block(path.read_text(), 1)) if LOSS in vals(rec)]
    assert len(loss_lines) == LOSS_PRINTS[name] and {rec.producer for rec in loss_lines} == {"user_print"}
    assert r["format"] == "deepspeed"
