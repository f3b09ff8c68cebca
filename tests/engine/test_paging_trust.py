"""A pager people can trust (issue 13): no page on healthy bf16 or fp16 runs, every collapse caught
with or without step numbers, overflow events counted per logical back-off, a skipped fp16 step
is no page, finished runs are not stalled, and each followed file is its own run.

Logs are written as files and read by the real reader, parsers, series state and shipped rules
(``replay``); lines are the producers' real shapes (reference/log-formats.md), and the corpus tests
replay the real logs of ../shared/corpus/logs."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CORPUS, corpus_path
from precision_agent.readers.runs import dump_run_labels, file_run, run_labels
from precision_agent.commands.replay import replay
from precision_agent.engine.rulefile import default_rules_dir, load_rules

RULES = load_rules([default_rules_dir()])
PAGE = ("page", "critical")


def run(tmp_path: Path, lines: list[str], name: str = "train.log") -> dict:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return replay(path, RULES)


def pages(r: dict) -> list[tuple[str, int | None]]:
    return [(f["rule"], f["line"]) for f in r["findings"] if f["severity"] in PAGE]


def rules_fired(r: dict) -> set[str]:
    return {f["rule"] for f in r["findings"]}


def megatron(it: int, scale: str, loss: str = "2.500000E+00", gnorm: str = "1.2", skipped: int = 0) -> str:
    return (f" iteration {it:>8}/    1000 | consumed samples: {it * 8:>12} | learning rate: 1.000000E-04 | "
            f"global batch size:     8 | lm loss: {loss} | loss scale: {scale} | grad norm: {gnorm} | "
            f"number of skipped iterations: {skipped:>3} | number of nan iterations:   0 |")


_EPOCH = [0]


def hf(loss: str = "1.2", gnorm: str = "0.5", lr: str = "1e-05") -> str:
    """One HF Trainer dict; each a later epoch (identical lines would be copies from other ranks)."""
    _EPOCH[0] += 1
    return f"{{'loss': {loss}, 'grad_norm': {gnorm}, 'learning_rate': {lr}, 'epoch': {_EPOCH[0] / 100}}}"


# --- 1. precision mode: a constant 1.0 is no dynamic loss scale --------------------------------------

def test_issue_repro_bf16_megatron_constant_scale_does_not_page(tmp_path):
    r = run(tmp_path, [megatron(i, "1.0") for i in (10, 20, 30)])
    assert pages(r) == []
    assert r["loss_scaling"] == "no"


def test_argument_dump_bf16_is_read_and_does_not_page(tmp_path):
    lines = ["------------------------ arguments ------------------------",
             "  bf16 ............................................ True",
             "  fp16 ............................................ False",
             "-------------------- end of arguments ---------------------"]
    r = run(tmp_path, lines + [megatron(i, "1.0") for i in range(1, 40)])
    assert r["precision"] == "bf16" and r["loss_scaling"] == "no"
    assert pages(r) == []


def test_known_fp16_run_sitting_at_the_floor_pages(tmp_path):
    lines = ["  fp16 ............................................ True",
             "  bf16 ............................................ False"]
    r = run(tmp_path, lines + [megatron(i, "1.0") for i in (10, 20, 30)])
    assert r["precision"] == "fp16"
    assert ("LossScaleAtFloor", 3) in pages(r)


def test_dynamic_scaler_that_came_down_to_the_floor_pages(tmp_path):
    r = run(tmp_path, [megatron(10, "4.0"), megatron(20, "2.0"), megatron(30, "1.0")])
    assert ("LossScaleAtFloor", 3) in pages(r)


def test_constant_one_of_unknown_mode_pages_once_overflows_show_a_scaler(tmp_path):
    """A scaler stuck at 1 from the first line (the agent started late) skips every step."""
    r = run(tmp_path, [megatron(10, "1.0"), megatron(20, "1.0", skipped=10), megatron(30, "1.0", skipped=10)])
    assert "LossScaleAtFloor" in {name for name, _ in pages(r)}


@pytest.mark.parametrize("line, mode", [
    ("[2024-05-01 10:00:00,000] [INFO] [config.py:987:print]   bfloat16_enabled ............. True", "bf16"),
    ("[2024-05-01 10:00:00,000] [INFO] [config.py:987:print]   fp16_enabled ................. True", "fp16"),
    ("bf16=True,", "bf16"),
    ("fp16=True,", "fp16"),
    ("Namespace(no_progress_bar=False, fp16=True, memory_efficient_fp16=False)", "fp16"),
    ("Mixed precision type: bf16", "bf16"),
    ("mixed_precision: 'no'", "fp32"),
    ("cmd = deepspeed pretrain_gpt.py --num-layers 24 --bf16 --seq-length 2048", "bf16"),
    ("Using 16bit Automatic Mixed Precision (AMP)", "fp16"),
    ("Using bfloat16 Automatic Mixed Precision (AMP)", "bf16"),
    ("Selected optimization level O0:  Pure FP32 training.", "fp32"),
    ("  params_dtype .................................... torch.bfloat16", "bf16"),
    ("'compute_dtype': 'bfloat16', 'layernorm_compute_dtype': 'float32'", "bf16"),
    ("\"bf16\": {\"enabled\": true}", "bf16"),
])
def test_precision_statements(tmp_path, line, mode):
    r = run(tmp_path, [line, megatron(10, "1.0")])
    assert r["precision"] == mode


@pytest.mark.parametrize("line", ["  fp16 ............................................ False",
                                  "fp16_full_eval=False,", "bf16_full_eval=True,",
                                  "loss_scale             : None",
                                  "  --fp16                Use fp16 mixed precision (default: False)",
                                  "WARNING: fp16=True is not supported on this device, falling back",
                                  "skipping --bf16 since the GPU lacks support",
                                  "precision_mode: allow_fp32_to_fp16"])
def test_no_precision_from_negatives_or_lookalikes(tmp_path, line):
    assert run(tmp_path, [line, megatron(10, "1.0")])["precision"] is None


# --- 3. collapse without steps --------------------------------------------------------------------

def test_apex_collapse_without_steps_pages(tmp_path):
    lines = []
    v = 256.0
    while v > 2:
        v /= 2
        lines.append(f"  3%|▎  | 10/300 [00:01<00:30,  9.5it/s]Gradient overflow.  Skipping step, loss scaler 0 "
                     f"reducing loss scale to {v}")
    r = run(tmp_path, lines)
    assert r["steps"] == {"first": None, "last": None}
    assert "LossScaleCollapse" in {name for name, _ in pages(r)}


def test_deepspeed_under_hf_collapse_in_the_middle_of_a_file_pages(tmp_path):
    lines = [hf() for _ in range(30)]
    v = 64
    while v > 2:
        lines.append("[2024-01-01 10:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! "
                     f"Rank 0 Skipping step. Attempted loss scale: {v}, reducing to {v // 2}")
        lines.append(hf())
        v //= 2
    r = run(tmp_path, lines)
    assert r["loss_scale"]["last"] == 2
    assert "LossScaleCollapse" in {name for name, _ in pages(r)}


def torch_npu_collapse(start: float = 128.0, end: float = 2.0) -> list[str]:
    """Two ranks, no step numbers: each rank prints the skip message (two of them glued on one line
    at times) and then the back-off message."""
    lines, v, i = [hf()], start, 0
    while v > end:
        v /= 2
        if i % 2:
            lines.append("Gradient overflow. Skipping stepGradient overflow. Skipping step")
        else:
            lines += ["Gradient overflow. Skipping step", "Gradient overflow. Skipping step"]
        lines += [f"Loss scaler reducing loss scale to {v}"] * 2
        lines.append(hf())
        i += 1
    return lines


def test_torch_npu_two_ranks_collapse_pages_and_counts_one_overflow_per_backoff(tmp_path):
    r = run(tmp_path, torch_npu_collapse())
    assert r["loss_scale"]["decreases"] == 6
    assert r["overflow_steps"] == 6
    assert "LossScaleCollapse" in {name for name, _ in pages(r)}


def test_interleaved_rank_copies_count_once_per_backoff(tmp_path):
    """Rank 1's copies come after rank 0's back-off message: still one event per back-off."""
    lines, v = [], 1024.0
    for _ in range(5):
        v /= 2
        lines += ["Gradient overflow. Skipping step", f"Loss scaler reducing loss scale to {v}",
                  "Gradient overflow. Skipping step", f"Loss scaler reducing loss scale to {v}"]
    r = run(tmp_path, lines)
    assert r["loss_scale"]["decreases"] == 5 and r["overflow_steps"] == 5


def test_warm_up_back_off_from_a_high_scale_is_no_page(tmp_path):
    lines, v = [hf()], 65536
    while v > 2048:  # the usual fp16 start: 2^16 down to 2^11, then it settles
        lines.append("[2024-01-01 10:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! "
                     f"Rank 0 Skipping step. Attempted loss scale: {v}, reducing to {v // 2}")
        v //= 2
    lines += [hf() for _ in range(50)]
    assert pages(run(tmp_path, lines)) == []


def test_megatron_interval_reports_collapse(tmp_path):
    """Several halvings hidden between two interval reports count as back-offs."""
    r = run(tmp_path, [megatron(10, "65536.0"), megatron(20, "4096.0", skipped=4),
                       megatron(30, "4.0", skipped=10)])
    assert "LossScaleCollapse" in {name for name, _ in pages(r)}
    assert r["overflow_steps"] >= 14  # 4 + 10 halvings, whatever the counters said


def test_fairseq_low_healthy_scale_is_no_collapse(tmp_path):
    lines = []
    for v in (64.0, 32.0, 16.0, 8.0, 4.0, 2.0):
        lines.append(f"2022-10-19 03:46:58 | INFO | fairseq.trainer | NOTE: gradient overflow detected, "
                     f"ignoring gradient, setting loss scale to: {v}")
    assert pages(run(tmp_path, lines)) == []


# --- 4. overflow events ------------------------------------------------------------------------------

def test_backoffs_without_messages_are_overflow_events(tmp_path):
    r = run(tmp_path, [megatron(10, "32768.0"), megatron(20, "8192.0"), megatron(30, "8192.0")])
    assert r["loss_scale"]["decreases"] == 1
    assert r["overflow_steps"] == 2  # two halvings, though the counter says 0


# --- 5. a non-finite grad norm on a skipped step ----------------------------------------------------

def test_one_inf_grad_norm_in_an_fp16_hf_run_is_an_overflow_not_a_page(tmp_path):
    lines = [hf(gnorm="0.5") for _ in range(5)] + [hf(gnorm="inf")] + [hf(gnorm="0.4") for _ in range(5)]
    r = run(tmp_path, lines)
    assert pages(r) == []
    assert r["overflow_steps"] == 1


def test_persisting_inf_grad_norm_pages(tmp_path):
    r = run(tmp_path, [hf(gnorm="0.5") for _ in range(20)] + [hf(gnorm="inf") for _ in range(4)])
    assert ("TrainingNonFinite", 23) in pages(r)
    assert ("TrainingNonFinite", 22) not in pages(r)


def test_fp16_warm_up_overflows_at_the_start_are_no_page(tmp_path):
    """GradScaler / DeepSpeed start high and overflow the first steps in a row (logging_steps=1)."""
    lines = ["fp16=True,"] + [hf(gnorm="inf") for _ in range(6)] + [hf() for _ in range(30)]
    assert pages(run(tmp_path, lines)) == []
    lines = ["[2024-05-01 10:00:00,000] [INFO] [config.py:987:print]   fp16_enabled ................. True"]
    v = 65536
    for _ in range(6):
        lines.append("[2024-01-01 10:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! "
                     f"Rank 0 Skipping step. Attempted loss scale: {v}, reducing to {v // 2}")
        lines.append(hf(gnorm="inf"))
        v //= 2
    r = run(tmp_path, lines + [hf() for _ in range(20)])
    assert pages(r) == [] and r["overflow_steps"] == 6


def test_inf_grad_norms_the_scaler_explains_after_warm_up_are_no_page(tmp_path):
    lines = [hf() for _ in range(30)]
    v = 65536
    for _ in range(5):  # later overflows, each announced by the scaler and backed off
        lines.append("[2024-01-01 10:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! "
                     f"Rank 0 Skipping step. Attempted loss scale: {v}, reducing to {v // 2}")
        lines.append(hf(gnorm="inf"))
        v //= 2
    assert pages(run(tmp_path, lines)) == []


def test_nan_loss_pages_at_once(tmp_path):
    assert ("TrainingNonFinite", 2) in pages(run(tmp_path, [hf(), hf(loss="nan", gnorm="nan")]))


def test_inf_grad_norm_without_loss_scaling_pages_at_once(tmp_path):
    r = run(tmp_path, ["bf16=True,", "fp16=False,", hf(), hf(gnorm="inf")])
    assert r["precision"] == "bf16"
    assert ("TrainingNonFinite", 4) in pages(r)


def test_nan_grad_norm_in_bf16_megatron_pages_at_once(tmp_path):
    r = run(tmp_path, [megatron(10, "1.0"), megatron(20, "1.0", gnorm="nan")])
    assert ("TrainingNonFinite", 2) in pages(r)


# --- 6. finished runs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("marker", ["[after training is done]", "Training completed. Do not forget to share your model",
                                    "2022-10-19 04:02:11 | INFO | fairseq_cli.train | done training in 798.6 seconds",
                                    "[2024-01-01 10:00:00,000] [INFO] [launch.py:351:main] Process 23917 exits successfully.",
                                    "`Trainer.fit` stopped: `max_epochs=3` reached.",
                                    "{'train_runtime': 812.3, 'train_samples_per_second': 3.9, 'train_loss': 0.41, 'epoch': 3.0}"])
def test_end_of_training_markers(tmp_path, marker):
    assert run(tmp_path, [megatron(10, "1.0"), marker])["finished"] is True


@pytest.mark.parametrize("line", ["saving checkpoint at iteration 10", "Training completed 50%",
                                  "Training completed for shard 3"])
def test_no_end_without_a_marker(tmp_path, line):
    assert run(tmp_path, [megatron(10, "1.0"), line])["finished"] is False


def test_stalled_is_quiet_after_the_end_and_fires_without_it():
    from precision_agent.model import LOSS, TRAINING_END, Sample, SourcePos
    from precision_agent.engine.pipeline import Pipeline
    for finished in (False, True):
        p = Pipeline(RULES.fresh(), keep_findings=100)
        labels = (("run", "r"),)
        p.process([Sample(labels, LOSS, 2.0, 10, SourcePos("t.log", 1), time=1000.0, producer="megatron")])
        if finished:
            p.process([Sample(labels, TRAINING_END, 1.0, None, SourcePos("t.log", 2), time=1000.0,
                              producer="hints")])
        p.tick(1000.0 + 3600)
        p.tick(1000.0 + 3700)
        stalled = [f for f in p.findings if f.rule == "TrainingStalled"]
        assert bool(stalled) is (not finished)


# --- 2. run identity -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, run_, rank", [
    ("train.log", "train", None), ("train.log.1", "train", None), ("train.log-20250101", "train", None),
    ("train_rank3.log", "train", "3"), ("rank-0.out", "rank", "0"), ("my run (2).log", "my_run_2", None),
])
def test_file_run_names(name, run_, rank):
    assert file_run(f"/data/logs/{name}") == (run_, rank)


def test_run_names_are_bounded_and_path_free():
    run_, _ = file_run("/secret/dir/" + "x" * 500 + ".log")
    assert len(run_) <= 64 and "/" not in run_ and "secret" not in run_
    assert run_labels("/a/b/run-7/stdout.log", "parent_dir", {}) == {"run": "run-7"}
    assert run_labels("/a/b/train.log", "file", {"run": "mine"}) == {"run": "mine"}
    assert run_labels("/a/b/train.log", "label", {"job": "j"}) == {"job": "j"}


def test_a_step_that_goes_back_is_a_new_attempt_not_an_increase(tmp_path):
    first = [megatron(i, v) for i, v in ((10, "8.0"), (20, "4.0"), (30, "2.0"), (40, "1.0"))]
    second = [megatron(i, "65536.0") for i in (10, 20, 30)]
    r = run(tmp_path, first + second)
    assert r["attempts"] == 2
    assert r["loss_scale"]["increases"] == 0


# --- 7. the regression gate on the real corpus -------------------------------------------------------

def _index_rows(index: Path) -> dict[str, str]:
    rows = {}
    for line in index.read_text().splitlines():
        m = re.match(r"\|\s*([\w.]+\.log)\s*\|", line)
        if m:
            rows[m.group(1)] = line
    return rows


def _corpus_logs() -> list[Path]:
    return sorted(CORPUS.glob("logs/*.log")) + sorted(CORPUS.glob("logs/healthy/*.log"))


# failure-corpus logs whose INDEX.md row shows a real failure a page is right for: a loss scale gone
# below 1 (apex_1), NaN grad norms on every report from some point on (hf_trainer_1), inf on all
# 75 lines (hf_trainer_5)
REAL_FAILURES = {"apex_1.log": "LossScaleCollapse", "hf_trainer_1.log": "TrainingNonFinite",
                 "hf_trainer_5.log": "TrainingNonFinite"}


@pytest.mark.corpus
def test_no_healthy_corpus_log_pages():
    healthy = corpus_path("logs", "healthy")
    logs = sorted(healthy.glob("*.log"))
    assert set(_index_rows(healthy / "INDEX.md")) == {p.name for p in logs}
    for path in logs:
        r = replay(path, RULES)
        assert pages(r) == [], (path.name, pages(r))


@pytest.mark.corpus
def test_failure_corpus_pages_only_where_index_shows_a_real_failure():
    logs = corpus_path("logs")
    rows = _index_rows(logs / "INDEX.md")
    assert set(REAL_FAILURES) <= set(rows)
    for name in rows:
        r = replay(logs / name, RULES)
        fired = {rule for rule, _ in pages(r)}
        if name in REAL_FAILURES:
            assert REAL_FAILURES[name] in fired, (name, fired)
        else:
            assert fired == set(), (name, fired)


@pytest.mark.corpus
def test_every_collapse_the_index_lists_fires():
    """A collapse in INDEX.md: a loss scale that fell below 1 outside fairseq (whose floor is 1e-4)."""
    logs = corpus_path("logs")
    collapses = [name for name, row in _index_rows(logs / "INDEX.md").items()
                 if "below 1" in row and not name.startswith("fairseq")]
    assert collapses
    for name in collapses:
        assert "LossScaleCollapse" in rules_fired(replay(logs / name, RULES)), name


@pytest.mark.corpus
def test_overflow_steps_at_least_decreases_on_every_corpus_log():
    corpus_path("logs")
    for path in _corpus_logs():
        r = replay(path, RULES)
        if r["loss_scale"]:
            assert r["overflow_steps"] >= r["loss_scale"]["decreases"], path.name


@pytest.mark.corpus
def test_real_hf_fp16_inf_grad_norm_lines_are_overflows(tmp_path):
    """hf_trainer_3/4: one 'grad_norm': inf each (a step the GradScaler skipped): counted, no page."""
    for name in ("hf_trainer_3.log", "hf_trainer_4.log"):
        r = replay(corpus_path("logs", name), RULES)
        assert r["overflow_steps"] == 1 and pages(r) == [], name


@pytest.mark.corpus
def test_real_finished_runs_are_marked_finished():
    for name in ("megatron_1.log", "megatron_deepspeed_1.log", "mindspeed_1.log", "fairseq_1.log", "hf_trainer_2.log"):
        assert replay(corpus_path("logs", "healthy", name), RULES)["finished"], name


@pytest.mark.corpus
def test_real_bf16_megatron_lines_under_an_fp16_argument_dump_page(tmp_path):
    """The same real bf16 lines page once the log says fp16: the decision is the precision mode's."""
    real = corpus_path("logs", "healthy", "megatron_1.log").read_text()
    path = tmp_path / "train.log"
    path.write_text("  fp16 ............................................ True\n" + real)
    assert "LossScaleAtFloor" in {rule for rule, _ in pages(replay(path, RULES))}


def test_replay_json_has_the_run_fields(tmp_path):
    path = tmp_path / "b.log"
    path.write_text("\n".join(megatron(i, "1.0") for i in (10, 20, 30)) + "\n")
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "replay", "--json", str(path)],
                          capture_output=True, text=True, timeout=120)
    out = json.loads(proc.stdout)
    assert out["findings"] == []
    assert {"precision", "loss_scaling", "finished", "attempts"} <= set(out)


@pytest.mark.corpus
def test_real_rank_copies_of_apex_messages_count_once():
    """healthy/apex_1: 24 overflow lines, 8 ranks x 3 back-offs: 3 events, 3 decreases."""
    r = replay(corpus_path("logs", "healthy", "apex_1.log"), RULES)
    assert r["loss_scale"]["decreases"] == 3 and r["overflow_steps"] == 3


@pytest.mark.corpus
def test_real_finished_run_is_not_stalled_but_the_same_lines_without_the_end_are(tmp_path):
    from precision_agent.engine.pipeline import Pipeline
    from precision_agent.readers.logstream import LogStream
    real = corpus_path("logs", "healthy", "megatron_1.log").read_text()
    cut = real[:real.index("[after training is done]")]
    cut = cut[:cut.rfind("\n") + 1]
    for text, stalled in ((real, False), (cut, True)):
        path = tmp_path / "train.log"
        path.write_text(text)
        p = Pipeline(RULES.fresh(), keep_findings=1000)
        stream = LogStream(str(path), {"run": "r"})
        p.process(stream.finish(now=1000.0))
        stream.close()
        for t in (1000.0 + 3600, 1000.0 + 3700):
            p.tick(t)
        assert bool([f for f in p.findings if f.rule == "TrainingStalled"]) is stalled


def test_a_new_attempt_clears_the_state_alerts_of_the_one_before(tmp_path):
    from precision_agent.model import AlertState
    from precision_agent.engine.pipeline import Pipeline
    from precision_agent.readers.logstream import LogStream
    path = tmp_path / "train.log"
    path.write_text("\n".join([megatron(i, f"{2.0 ** (16 - i)}") for i in range(1, 16)]
                              + [megatron(i, "65536.0") for i in (5, 6, 7)]) + "\n")
    p = Pipeline(RULES.fresh(), keep_findings=1000)
    stream = LogStream(str(path), {"run": "r"})
    p.process(stream.finish(now=1000.0))
    stream.close()
    assert {f.rule for f in p.findings} >= {"LossScaleCollapse"}
    states = {a.rule: a.state for a in p.alerts.alerts.values()}
    assert states["LossScaleCollapse"] == AlertState.RESOLVED



# --- review findings: attempts, evidence per attempt, silent regrowth ----------------------------------

def test_per_epoch_step_counters_are_no_new_attempts(tmp_path):
    lines = [f"epoch:{e}  step: {i} , loss:  0.{60 - e * 10 - i} ,  time: 98.2045  acc: 0.9375"
             for e in range(1, 4) for i in range(5)]
    r = run(tmp_path, lines)
    assert r["attempts"] == 1


def test_two_ranks_out_of_step_without_prefixes_are_no_new_attempts(tmp_path):
    lines = []
    for it in range(10, 200, 10):
        lines += [megatron(it, "65536.0"), megatron(it - 10 if it > 10 else it, "65536.0")]
    assert run(tmp_path, lines)["attempts"] == 1


def test_a_restart_still_is_a_new_attempt(tmp_path):
    lines = [megatron(i, "65536.0") for i in range(10, 310, 10)] + [megatron(i, "65536.0") for i in range(200, 260, 10)]
    assert run(tmp_path, lines)["attempts"] == 2


def test_an_fp16_attempt_does_not_make_the_bf16_attempt_after_it_dynamic(tmp_path):
    fp16 = ["  fp16 ............................................ True",
            "  bf16 ............................................ False",
            megatron(10, "65536.0"), megatron(20, "32768.0"), megatron(30, "32768.0")]
    bf16 = ["  bf16 ............................................ True",
            "  fp16 ............................................ False"] + [megatron(i, "1.0") for i in (10, 20, 30)]
    r = run(tmp_path, fp16 + bf16)
    assert r["attempts"] == 2 and r["precision"] == "bf16"
    assert pages(r) == []


def test_torch_npu_backoff_after_a_silent_regrowth_is_an_overflow(tmp_path):
    lines = []
    for _ in range(5):
        lines += ["Gradient overflow. Skipping step", "Gradient overflow. Skipping step",
                  "Loss scaler reducing loss scale to 32768.0", "Loss scaler reducing loss scale to 32768.0", hf()]
    assert run(tmp_path, lines)["overflow_steps"] == 5


def test_first_nonfinite_step_of_the_attempt_ignores_skipped_steps():
    """The step of the first NaN/Inf that is no scaler's skipped step (exported per series; the
    fleet's TrainingNonFiniteOrigin rule takes the lowest across ranks)."""
    from precision_agent.model import GRAD_NORM, LOSS, LOSS_SCALE, Sample, SourcePos
    from precision_agent.series.state import SeriesState
    st = SeriesState((("run", "r"),))
    def feed(metric, value, step, log_time=None):
        st.ingest(Sample(st.labels, metric, value, step, SourcePos("t.log", step), 100.0 + step, log_time,
                         producer="hf_trainer"))
    feed(LOSS_SCALE, 65536.0, 1)
    feed(LOSS_SCALE, 32768.0, 2)   # a dynamic scaler
    feed(LOSS, 2.0, 3)
    feed(GRAD_NORM, math.inf, 3)   # a skipped step
    assert st.first_nonfinite_step is None
    feed(LOSS, math.nan, 7, log_time=5000.0)
    feed(LOSS, math.nan, 8)
    assert (st.first_nonfinite_step, st.first_nonfinite_time) == (7, 5000.0)
    st.new_attempt()
    assert st.first_nonfinite_step is None


def test_first_nonfinite_step_is_exported():
    from precision_agent.exporters.metrics import AgentCollector
    from precision_agent.health import Health
    from precision_agent.model import LOSS, Sample, SourcePos
    from precision_agent.engine.pipeline import Pipeline
    p = Pipeline(RULES.fresh())
    p.process([Sample((("run", "r"), ("rank", "3")), LOSS, math.nan, 42, SourcePos("t.log", 1), 100.0, 1234.5)])
    got = {m.name: m.samples for m in AgentCollector(Health(), p).collect()}
    (step,) = got["precision_agent_training_first_nonfinite_step"]
    (when,) = got["precision_agent_training_first_nonfinite_timestamp_seconds"]
    assert step.value == 42 and step.labels == {"run": "r", "rank": "3"} and when.value == 1234.5


def test_a_new_rank_after_a_restart_inherits_the_runs_stated_precision():
    """The run's hints are not stored, but its restored series know what the log stated."""
    from precision_agent.model import LOSS, Sample, SourcePos
    from precision_agent.engine.pipeline import Pipeline
    from precision_agent.series.state import SeriesState
    before = SeriesState((("rank", "0"), ("run", "r")))
    before.precision = "bf16"
    p = Pipeline(RULES.fresh())
    p.series[before.labels] = SeriesState.from_dict(before.labels, before.to_dict(context=True))  # as restored
    p.process([Sample((("rank", "1"), ("run", "r")), LOSS, 2.0, 5, SourcePos("t.log", 1), 1.0)])
    assert p.series[(("rank", "1"), ("run", "r"))].precision == "bf16"


@pytest.mark.parametrize("unit, run", [
    ("/w/job_a/step3/rank1", "job_a"),                      # msprobe: the folder above step*/rank*
    ("/w/job_a/step3/proc4075", "job_a"),
    ("/w/step3/rank1", "w"),                                # dumps directly in the watched folder
    ("/w/gpt/20240301120000/2/ge_default/1/5", "gpt"),      # CANN: {time}/{device}/{model}/{model_id}/{step}
    ("/w/ms_run/rank_0/Net/0/3", "ms_run"),                 # MindSpore: rank_{id}/{net}/{graph}/{iteration}
    ("/w/a/b/npy", "npy"),
    ("/w/job_a/step3/rank", "job_a"),                       # msprobe, a single rank
    ("/w/run/step1", "run"),                                # a tree of .npy files per step
    # a number above the layout is a folder of the user's: a SLURM job id, Hydra's multirun/<date>/<time>/<n>
    ("/w/123456/step0/rank0", "123456"),
    ("/w/multirun/2024-03-01/12-00-00/1/step0/rank0", "1"),
    ("/w/654321/gpt/20240301120000/2/ge_default/1/5", "gpt"),
    ("/w/7/ms_run/rank_0/Net/0/3", "ms_run"),
    ("/w/job_b/3/1", "1"),                                  # numbers alone are no known layout
])
def test_dump_run_names(unit, run):
    assert dump_run_labels(unit, "/w", "file", {"job": "j"}) == {"job": "j", "run": run}
    assert dump_run_labels(unit, unit, "file", {})["run"] == unit.rsplit("/", 1)[1]   # never above the watch
    assert dump_run_labels(unit, "/w", "label", {"job": "j"}) == {"job": "j"}
    assert dump_run_labels(unit, "/w", "file", {"run": "mine"}) == {"run": "mine"}


def test_run_of_a_file_in_a_sub_folder_of_the_watch_is_named_with_its_folders():
    assert run_labels("/w/job1/train.log", "file", {}, "/w") == {"run": "job1/train"}
    assert run_labels("/w/job2/train.log", "file", {}, "/w") == {"run": "job2/train"}
    assert run_labels("/w/train.log", "file", {}, "/w") == {"run": "train"}
    assert run_labels("/w/j/rank3.log", "file", {}, "/w") == {"run": "j", "rank": "3"}
    assert run_labels("/w/a b/c/train_rank2.log.1", "file", {}, "/w") == {"run": "a_b/c/train", "rank": "2"}
    assert run_labels("/w/j/train.log", "file", {"run": "mine"}, "/w") == {"run": "mine"}
    long = run_labels("/w/" + "d" * 80 + "/t.log", "file", {}, "/w")["run"]
    assert len(long) <= 64 and long != run_labels("/w/" + "d" * 80 + "/u.log", "file", {}, "/w")["run"]
