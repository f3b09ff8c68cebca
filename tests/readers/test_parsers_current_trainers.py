"""What today's trainers print, line by line: transformers 5's quoted ``.4g`` dicts, the NaN filter's
hidden NaN loss, DeepSpeed 0.19's exit at its minimum loss scale. The same shapes from the real
libraries are in tests/fixtures/trainers (tests/readers/test_trainer_fixtures.py)."""

import math

from precision_agent.model import GRAD_NORM, LEARNING_RATE, LOSS, OVERFLOW
from precision_agent.readers.parsers import Block, CompositeParser
from precision_agent.readers.parsers.deepspeed import DeepSpeedParser
from precision_agent.readers.parsers.hf_trainer import HFTrainerParser
from support.commands import replay_json


def vals(rec):
    return {m: v for m, v, _ in rec.values}


def parse(cls, text):
    recs = cls().parse(Block(text, 1))
    auto = [r for r in CompositeParser().parse(Block(text, 1)) if r.producer != "hints"]
    assert [(r.line, repr(r.values)) for r in auto] == [(r.line, repr(r.values)) for r in recs]
    return recs


def test_hf5_quoted_4g_values_large_and_nonfinite():
    text = ("{'loss': '8.984', 'grad_norm': '0.2509', 'learning_rate': '0.0001136', 'epoch': '0.00624'}\n"
            "{'loss': '9.53e+05', 'grad_norm': 'inf', 'learning_rate': '1e-05', 'epoch': '1'}\n"
            "{'loss': '0', 'grad_norm': 'nan', 'learning_rate': '0', 'epoch': '2'}\n"
            "{'loss': '-inf', 'grad_norm': '-nan', 'learning_rate': 'n/a', 'epoch': '2'}\n"
            "{'loss': 0.6931, 'grad_norm': nan, 'learning_rate': 5e-05, 'epoch': 0.5}\n"  # 4.x repr
            "{'loss': 'high', 'note': '12'}\n"
            "{'train_runtime': '12.3', 'train_loss': '0.5', 'epoch': '3'}\n")
    a, b, c, d, e = parse(HFTrainerParser, text)
    assert vals(a) == {LOSS: 8.984, GRAD_NORM: 0.2509, LEARNING_RATE: 0.0001136}
    assert vals(b)[LOSS] == 9.53e5 and vals(b)[GRAD_NORM] == math.inf
    assert vals(c)[LOSS] == 0.0 and math.isnan(vals(c)[GRAD_NORM])
    assert vals(d)[LOSS] == -math.inf and math.isnan(vals(d)[GRAD_NORM]) and LEARNING_RATE not in vals(d)
    assert vals(e)[LOSS] == 0.6931 and math.isnan(vals(e)[GRAD_NORM])
    assert [r.line for r in (a, b, c, d, e)] == [1, 2, 3, 4, 5]


def test_hf_quoted_step_of_a_wrapper():
    (a,) = parse(HFTrainerParser, "{'loss': '1.5', 'global_step/max_steps': '12/100', 'grad_norm': '2'}\n")
    assert a.step == 12 and vals(a) == {LOSS: 1.5, GRAD_NORM: 2.0}


def hf5_log(path, n, hidden_from=None, skips=(), logging_steps=1):
    lines = []
    for i in range(1, n + 1):
        loss, gn = f"{2.0 - i * 0.01:.4g}", "0.25"
        if hidden_from is not None and i >= hidden_from:
            loss, gn = "0", "nan"
        elif i in skips:
            gn = "inf"  # a GradScaler skip: the loss is finite
        lines.append(f"{{'loss': '{loss}', 'grad_norm': '{gn}', 'learning_rate': '{1e-4 * (1 - i / n):.4g}', "
                     f"'epoch': '{i * logging_steps / 100:.4g}'}}\n")
    lines.append("{'train_runtime': '3.1', 'train_samples_per_second': '64', 'train_loss': '1.2', 'epoch': '1'}\n")
    path.write_text("".join(lines))


def test_hidden_nan_loss_pages_on_its_second_report_where_the_loss_may_be_scaled(tmp_path):
    log = tmp_path / "train.log"
    hf5_log(log, 40, hidden_from=5)  # within the grad-norm warm-up: only the zero loss tells
    r = replay_json(log)
    pages = [f for f in r["findings"] if f["severity"] == "page"]
    # found on the second report in a row (line 6), naming the first (line 5, report 5): where it began
    assert pages and pages[0]["rule"] == "TrainingNonFinite" and pages[0]["line"] == 5
    assert "loss" in pages[0]["summary"]


def test_hidden_nan_loss_pages_at_once_in_a_run_stated_bf16(tmp_path):
    log = tmp_path / "train.log"
    hf5_log(log, 40, hidden_from=5)
    log.write_text("TrainingArguments(output_dir='out', bf16=True, fp16=False)\n" + log.read_text())
    r = replay_json(log)
    pages = [f for f in r["findings"] if f["severity"] == "page"]
    assert pages and pages[0]["rule"] == "TrainingNonFinite" and pages[0]["line"] == 6  # report 5, after the hint


def test_one_overflow_beside_a_rounded_zero_loss_does_not_page(tmp_path):
    """HF 4.x logs round(loss, 4): a converged loss prints 0.0, and one routine GradScaler
    overflow gives {'loss': 0.0, 'grad_norm': inf} once; the next report is healthy again."""
    log = tmp_path / "train.log"
    lines = [f"{{'loss': {0.0 if i >= 20 else round(1.0 / i, 4)}, 'grad_norm': {'inf' if i in (30, 44) else 0.01}, "
             f"'learning_rate': 1e-05, 'epoch': {i / 100}}}\n" for i in range(1, 60)]
    log.write_text("".join(lines))
    r = replay_json(log)
    assert not [f for f in r["findings"] if f["severity"] == "page"], r["findings"]


def test_fp16_skips_with_finite_loss_do_not_page(tmp_path):
    log = tmp_path / "train.log"
    hf5_log(log, 60, skips=(2, 3, 4, 20, 41, 55))
    r = replay_json(log)
    assert not [f for f in r["findings"] if f["severity"] == "page"], r["findings"]
    assert r["overflow_steps"] == 6


def test_zero_loss_beside_a_finite_grad_norm_is_no_hidden_nan(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("".join(f"{{'loss': '0', 'grad_norm': '0.{i + 1}', 'epoch': '{i}'}}\n" for i in range(5)))
    r = replay_json(log)
    assert not [f for f in r["findings"] if f["severity"] == "page"]


DS_EXIT = "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


def test_deepspeed_exit_at_minimum_scale_is_one_event():
    text = ("Traceback (most recent call last):\n"
            "  File \"/x/deepspeed/runtime/fp16/loss_scaler.py\", line 258, in update_scale\n"
            "    raise Exception(\n"
            "        \"Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.\")\n"
            f"[rank0]: {DS_EXIT}\n"
            "[2026-11-27 10:00:01,000] [WARNING] [loss_scaler.py:153:update_scale] [deepspeed] OVERFLOW! Skipping "
            "step. Gradients are non-finite, weights were not updated.\n")
    a, b = parse(DeepSpeedParser, text)
    assert (a.line, a.rank, a.values) == (5, "0", [(OVERFLOW, 1.0, (("variant", "min_scale_exit"),))])
    assert (b.line, b.values) == (6, [(OVERFLOW, 1.0, (("variant", "static"),))])


def test_deepspeed_exit_pages_loss_scale_collapse_without_backoffs(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("".join(f"step {i} loss {2.0 - i * 0.01:.4f}\n" for i in range(1, 30))
                   + "Traceback (most recent call last):\n  File \"train.py\", line 40, in <module>\n"
                   + f"{DS_EXIT}\n")
    r = replay_json(log)
    pages = [f for f in r["findings"] if f["severity"] == "page"]
    assert [f["rule"] for f in pages] == ["LossScaleCollapse"] and pages[0]["line"] == 32


RICH_LAST_FRAME = (
    "`Trainer.fit` stopped: `max_epochs=1` reached.\n"
    "Epoch 0/0  ━━━━━━━━━━━━━━━━━ 50/50 0:00:06 • 0:00:00 9.21it/s v_num: 0          \n"
    "                                                              train_loss_step:  \n"
    "                                                              {step}             \n"
    "                                                              train_loss_epoch: \n"
    "                                                              0.017             \n")


def test_lightning_rich_last_frame_wrapped_over_lines():
    from precision_agent.readers.parsers.lightning import LightningParser
    (a,) = parse(LightningParser, RICH_LAST_FRAME.format(step="nan  "))
    assert a.line == 2 and a.step is None and math.isnan(vals(a)[LOSS])
    (b,) = parse(LightningParser, "Epoch 3/9  ━━━━━━╸━━━━━━━━━━ 20/50 0:00:02 • 0:00:03 9.86it/s v_num: 1 "
                                  "train_loss_step: 0.123 train_loss_epoch: 0.200\n")
    assert vals(b) == {LOSS: 0.123}
    # a continuation line is part of the frame: no other parser reads "train_loss_step:" there
    recs = CompositeParser().parse(Block(RICH_LAST_FRAME.format(step="0.001"), 1))
    assert [(r.producer, r.line) for r in recs if r.producer != "hints"] == [("lightning", 2)]
    assert not parse(LightningParser, "Validation ━━━━━━━━━━━━ 5/5 0:00:00 • 0:00:00 50.1it/s\n")
