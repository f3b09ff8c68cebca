"""Fuzz targets of the log path: every parser's line shapes, the run-wide hints, the reader."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from precision_agent.readers.logstream import LogStream
from precision_agent.readers.parsers import FORMATS, Block, CompositeParser, UnknownFormat
from precision_agent.readers.parsers.hints import HintsParser

from .core import Target
from . import mutate
from .mutate import mutate_bytes, mutate_text, pick

# One or more real-shaped lines of every producer (docs/../shared/reference/log-formats.md).
SEEDS = [
    " [2024-09-03 15:56:55] iteration       20/  500000 | consumed samples:        20480 | elapsed time per "
    "iteration (ms): 12137.8 | throughput per GPU (TFLOP/s/GPU): 872.5 | learning rate: 6.976744E-07 | global batch "
    "size:  1024 | lm loss: 1.064275E+01 | loss scale: 262144.0 | grad norm: 47.021 | number of skipped iterations:"
    "   0 | number of nan iterations:   0 |",
    "0: [default0]: [2026-03-26 14:43:37.001748] iteration        1/      15 | consumed samples:           80 | "
    "lm loss: 1.048190E+01 | loss scale: 1.0 | grad norm: 3.2 |",
    " validation loss at iteration 7000 | lm loss value: 7.174200E+00 | lm loss PPL: 1.305315E+03 |",
    "[2023-07-24 13:21:32,378] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
    "Attempted loss scale: 4294967296, reducing to 2147483648",
    "[2024-09-15 00:13:28,261] [INFO] [loss_scaler.py:190:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
    "Attempted loss scale: 4294967296, but hysteresis is 2. Reducing hysteresis to 1",
    "[2023-10-31 08:58:26,908] [INFO] [unfused_optimizer.py:207:step] [deepspeed] fp16 dynamic loss scale overflow! "
    "Skipping step. Attempted loss scale: 8192.0, reducing to 4096.0",
    "v100x16-1: steps: 1 loss: 12.4023 iter time (s): 15.988 samples/sec: 0.250",
    "{'loss': 4.1445, 'grad_norm': 15.630965232849121, 'learning_rate': 2.1176470588235296e-06, 'epoch': 0.11}",
    "{'loss': 18.2196, 'grad_norm': inf, 'learning_rate': 0.0, 'epoch': 0.0}",
    "    39%|███▉      | 530/1352 [04:21<01:49,  7.53it/s]{'loss': 0.784039306640625, 'epoch': 0.39201183431952663}",
    "Step:      3 {'loss': 2.4395, 'grad_norm': inf, 'learning_rate': 8.000000000000001e-06, 'epoch': 0.0175}",
    "{'train_runtime': 1891.9246, 'train_samples_per_second': 5.816, 'train_loss': 0.31064462523529496, 'epoch': 3.0}",
    '2021-03-08 12:31:36 | INFO | train_inner | {"epoch": 1, "update": 0.0, "loss": "16.475", "ppl": "91120.8", '
    '"wps": "0", "ups": "0", "wpb": "16384", "bsz": "8", "num_updates": "1", "lr": "2e-05", "gnorm": "20.751", '
    '"loss_scale": "4", "train_wall": "99", "gb_free": "9.3", "wall": "105"}',
    "2022-10-18 04:37:45 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, setting "
    "loss scale to: 64.0",
    "| WARNING: overflow detected, setting loss scale to: 64.0",
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0",
    "epoch:1  step: 0 , loss:  0.0681 ,  time: 113.6311  acc: 1.0000",
    "epoch: 397 step: 2, loss is 0.38392675",
    "epoch: 487 step: 1, loss is Tensor(shape=[], dtype=Float32, value= 0.663754)",
    "epoch: 1 step: 100, lr: 0.0001000, loss: 0.123456, loss scale: 65536.",
    "[INFO] 2023-07-11 10:47:36,427 [/root/mindformers/core/callback/callback.py:269] print_output_info: Epoch:[  1/  1], "
    "step:[    4/  125], loss:[2.244/2.244], time:507844.205 ms, lr:[0.], overflow cond: True, loss_scale: 268435460.0",
    "{ Epoch:[  1/  2], step:[    1/ 6250], loss: 10.411, per_step_time: 1346ms, lr: 0.0, overflow cond: False, "
    "loss_scale: 65536.0 }",
    "  [2025-09-11 14:09:46,954794][I][components/metrics:437:log] step:  1  loss: 10.8595  grad_norm:  3.2105  "
    "memory:  8.44GiB(13.20%)  tps: 149  tflops: 1.39  mfu: 0.47%",
    "    [rank0]:2025-02-13 11:33:35,026 - root - INFO - step:  1  loss: 12.2417  memory: 42.08GiB(30.10%)  tps: 1,478",
    "Epoch 0:  10%|█ | 10/100 [00:01<00:09, 9.9it/s, v_num=0, train_loss=2.5]",
    "\rEpoch 0:  20%|██| 20/100 [00:02<00:08, 9.9it/s, v_num=0, train_loss=2.25, train_loss_epoch=3.0, ",
    "> 2024-08-14 21:07:31 iter 4510: loss nan, time 1187.40ms, mfu 11.97%",
    "iter 4500: loss 3.9172, time 28841.06ms, mfu 11.62%",
    "[06/14 03:58:22 d2.utils.events]: eta: 3:27:16  iter: 519  total_loss: 1.382  loss_cls: 0.913  "
    "loss_box_reg: 0.441  time: 0.3108  data_time: 0.0047  lr: 0.005198  max_mem: 5216M",
    "04/17 08:52:36 - mmengine - INFO - Epoch(train) [2][180/612]  base_lr: 1.0000e-03 lr: 1.4472e-04  "
    "eta: 3:10:05  time: 2.3417  data_time: 0.0051  memory: 13584  loss: 1.9346  grad_norm: nan",
    "2021-11-23 07:14:50,962 - mmdet - INFO - Epoch [3][412/915]\tlr: 2.500e-04, eta: 4:02:37, time: 0.518, "
    "data_time: 0.084, memory: 6291, loss: 0.9",
    "04/17 09:00:01 - mmengine - INFO - Iter(train) [  50/80000]  lr: 1.0e-04  loss: 2.5000",
    "ERROR:tensorflow:Model diverged with loss = NaN.",
    "I1103 08:21:47.530912 139872204318528 basic_session_run_hooks.py:262] loss = 2.25, step = 100 (12.3 sec)",
    "INFO:tensorflow:loss = 0.6931472, step = 1",
    "INFO:tensorflow:Saving dict for global step 1000: accuracy = 0.9, global_step = 1000, loss = 0.25",
    'DLLL {"timestamp": "1700000000.1", "datetime": "2023-11-14 22:13:20", "elapsedtime": "1.0", "type": "LOG", '
    '"step": [1, 20], "data": {"loss": 7.5, "loss_scale": 65536}}',
    ':::MLLOG {"namespace": "", "time_ms": 1, "event_type": "POINT_IN_TIME", "key": "run_stop", "value": null, '
    '"metadata": {"status": "success"}}',
    '{"step": 12, "loss": 2.5, "grad_norm": null, "loss_scale": 1024.0, "lr": 1e-4}',
    '{"global_step": "4", "train/loss": "nan", "eval_loss": 2.5, "scale": 512}',
    "global_step=7 epoch 1 loss: tensor(2.3100, device='cuda:0', grad_fn=<NllLossBackward0>)",
    "step 12 | loss 2.25 | grad_norm 1.5 | lr 1e-4",
    "[30,  2200] loss: 1.344",
    "step:0, loss:5.453125",
    "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
    "  bf16 ............................................ True",
    "  params_dtype .................................... torch.bfloat16",
    "  fp16_enabled ........................ True",
    "TrainingArguments(bf16=True, fp16=False, output_dir='x')",
    "Namespace(fp16=True, amp=False)",
    '{"train_batch_size": 8, "bf16": {"enabled": true}, "fp16": {"enabled": false}}',
    "torchrun --nproc_per_node 8 pretrain_gpt.py --bf16 --tensor-model-parallel-size 2",
    "mixed_precision: bf16",
    "Using 16bit Automatic Mixed Precision (AMP)",
    "Selected optimization level O1:  Insert automatic casts around Pytorch functions and Tensor methods.",
    "loss_scale             : dynamic",
    "compute_dtype: float16",
    "DynamicLossScaleUpdateCell(loss_scale_value=65536.0)",
    "[after training is done]",
    " exiting program at iteration 2000",
    "Training completed. Do not forget to share your model on huggingface.co/models =)",
    "`Trainer.fit` stopped: `max_steps=10` reached.",
    "done training in 1234.5 seconds",
    "[2024-01-01 00:00:00,000] [INFO] [launch.py:347:main] Process 1234 exits successfully.",
    "Total training time: 1:02:03 (0.5 s / it)",
]
FRAGMENTS = [" iteration ", " | lm loss: ", " | loss scale: ", " | grad norm: ", "nan", "inf", "{'loss': ",
             "'grad_norm': ", '"loss": "', "[deepspeed] OVERFLOW! ", "Attempted loss scale: ", ", reducing to ",
             "loss scale to: ", "epoch: ", " step: ", "loss is ", "Tensor(shape=[], dtype=Float32, value=",
             "[rank0]:", "0: [default0]: ", "Epoch(train) [", "][", "eta: ", "total_loss: ", "loss = ", "step = ",
             "DLLL ", ":::MLLOG ", '"key": "run_stop"', '"status": "success"', " .......... ", "fp16", "bf16=True",
             "python train.py", ".py ", " --", "--fp16 ", "Mixed precision type: ", "Using bfloat16 ",
             "compute_dtype", "LossScaleManager", "Training completed", "|", ": ", "=", ", ", "[", "]", "(", ")",
             "\t", "\r", "\x1b[32m", "1" * 30, "-", ".", "e-", "E+", "  ", "step: 1  loss: 2.5 ", "| train_inner | {",
             "Epoch 1/2, Step 1/2, imgsize", "Saving dict for global step 1: ", "iteration 1/ 2 |", "loss: ",
             "{'loss': 1.0, ", "Epoch:[  1/  2], step:[ 1/ 2], loss: 1.0", "DLL 2024-01-01 00:00:00 - "]


def make_block(rng: random.Random, seeds: list[str] = SEEDS, max_len: int | None = None) -> str:
    max_len = mutate.TEXT_MAX if max_len is None else min(max_len, mutate.TEXT_MAX)
    lines = [pick(rng, seeds) for _ in range(rng.choice((1, 1, 2, 3, 6)))]
    lines = [mutate_text(rng, ln, FRAGMENTS, max_len) if rng.random() < 0.85 else ln for ln in lines]
    if rng.random() < 0.3:
        lines = [pick(rng, ("[rank3]: ", "0: [default0]: ", "v100x16-2:  ", "training-nlp-1  | ",
                            "\x1b[0m", "worker-7 >> "))] + lines
    return "\n".join(lines)[:max_len] + rng.choice(("\n", "\n", "", "\r\n"))


def _check_records(parser: CompositeParser, records: list) -> None:
    if parser.errors:
        raise AssertionError(f"a parser raised: {parser.errors[0]}")
    for rec in records:
        if not isinstance(rec.line, int) or rec.line < 1:
            raise AssertionError(f"bad record line {rec.line!r}")
        for metric, value, _attrs in rec.values:
            if not isinstance(metric, str) or not isinstance(value, float):
                raise AssertionError(f"bad value {metric!r}={value!r}")


def _make_parse(rng: random.Random) -> tuple[str, str, str | None]:
    fmt = "auto" if rng.random() < 0.8 else pick(rng, list(FORMATS))
    pattern = None
    if rng.random() < 0.04:
        fmt = "custom"
        pattern = pick(rng, [r"step (?P<step>\d+) loss (?P<loss>\S+)", "(", r"(?P<loss>(a+)+)$", "[",
                             r"(?P<step>\d+)(?P<step>\d+)", r"(?P<nope>x)", "", r"(?P<loss>[\d.e+-]+)" * 20])
    return make_block(rng), fmt, pattern


def _run_parse(payload: tuple[str, str, str | None], work: Path) -> None:
    text, fmt, pattern = payload
    parser = CompositeParser(fmt, pattern)
    _check_records(parser, parser.parse(Block(text, 1)))
    _check_records(parser, parser.parse(Block(text, 1000)))  # a second block: per-file parser state


HINT_SEEDS = [s for s in SEEDS if any(k in s for k in HintsParser.keywords)]
HINT_BAIT = ["fp16", "bf16", " ....", "...", " ", "python ", ".py", ".sh", " --", "--bf16x", '"key": "run_stop"',
             '"status": ', "Training completed", "compute_dtype", "'", '"fp16": {', '"enabled": ', "fp16=True",
             "mixed_precision", "Using 16bit ", "Automatic Mixed ", "LossScale", "exiting program at iteration ",
             "done training in 1", "Process 1 exits", "\t", "=", ":"]


def _make_hints(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return make_block(rng, HINT_SEEDS)
    # a line of bait repeated: the regex must stay linear-ish on it
    parts = [pick(rng, HINT_BAIT) for _ in range(rng.randint(1, 4))]
    line = "".join(parts) * rng.choice((10, 1000, 20000))
    return (pick(rng, HINT_SEEDS) + " " + line)[: mutate.TEXT_MAX * 2] + "\n"


def _run_hints(text: str, work: Path) -> None:
    for rec in HintsParser().parse(Block(text, 1)):
        if rec.line < 1:
            raise AssertionError(f"bad record line {rec.line}")


def _make_stream(rng: random.Random) -> tuple[bytes, int, int, int]:
    body = make_block(rng).encode("utf-8", "surrogatepass")
    if rng.random() < 0.5:
        body = mutate_bytes(rng, body, hot=len(body))
    if rng.random() < 0.2:
        body += bytes(rng.randrange(256) for _ in range(rng.randint(1, 512)))
    cut = rng.randint(0, len(body))
    return body, cut, rng.choice((64, 97, 4096, 1 << 20)), rng.choice((16, 1 << 12, 1 << 20)), rng.random() < 0.3


def _read_stream(path: Path, body: bytes, cut: int, chunk: int, max_line: int, reopen: bool) -> list:
    path.write_bytes(body[:cut])
    stream = LogStream(str(path), {"run": "fuzz"}, chunk_bytes=chunk, max_line_bytes=max_line)
    budget = 16 << 20
    try:
        got = stream.poll(budget)
        with open(path, "ab") as f:  # the rest arrives later, cut anywhere (even inside a character)
            f.write(body[cut:])
        if reopen:  # small turns with the descriptor closed between them (a tight max_open_files)
            done = stream.tailer.consumed_bytes
            while done < len(body):
                stream.close()  # as the follower closes an idle file: at rest it keeps less (logstream.py)
                tailer = stream.tailer  # (at rest: a new one, counting from 0)
                before = tailer.consumed_bytes
                got += stream.poll(chunk)
                if tailer.consumed_bytes == before:
                    raise AssertionError("no progress after a reopen")
                done += tailer.consumed_bytes - before
        got += stream.poll(budget) + stream.finish()
    finally:
        stream.close()
    return got


def _run_stream(payload: tuple[bytes, int, int, int, bool], work: Path) -> None:
    body, cut, chunk, max_line, reopen = payload
    got = _read_stream(work / "train.log", body, cut, chunk, max_line, reopen)
    for s in got:
        if s.source.line < 1 or not isinstance(s.value, float):
            raise AssertionError(f"bad sample {s!r}")
    if reopen:  # closing and reopening between turns changes nothing that comes out
        ref = _read_stream(work / "ref.log", body, cut, chunk, max_line, False)
        if [(s.source.line, repr(s.value)) for s in got] != [(s.source.line, repr(s.value)) for s in ref]:
            raise AssertionError("reading with reopens gave other samples than reading in one go")


# The kernel log (``format: kernel``): real Xid lines (tests/fixtures/kernel/README.md) in syslog,
# dmesg, /dev/kmsg and journal shapes, and the bait its regex must stay linear on.
KERNEL_SEEDS = [
    "May 18 19:02:39 gpu-node-a kernel: [ 8721.061820] NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
    "May 18 19:02:40 gpu-node-a kernel: NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for "
    "remapping, reset gpu to activate.",
    "[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp "
    "Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
    "[ 1204.123584] NVRM: Xid (PCI:0000:01:00): 13, Graphics SM Warp Exception on (GPC 2, TPC 0, SM 0): Illegal "
    "Instruction Encoding",
    "4,1894,8721061820,-;NVRM: Xid (PCI:0000:9b:00): 94, pid=1234, name=python3, Contained ECC error",
    "2026-05-18T07:14:51+0000 gpu-node-b kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, "
    "Ch 00000001 caused by previous Xid 149",
    "Jan 18 11:38:05 localhost kernel: [  269.517039] NVRM: Xid (0000:01:00): 3, C 00000005 SC 00000007 M 00001ffc",
    "MESSAGE=NVRM: Xid (PCI:0000:3b:00): 48, An uncorrectable double bit error (DBE) has been detected on GPU",
]
KERNEL_BAIT = ["NVRM: Xid (", "PCI:", "0000:", "3b:00", "): ", "79", ", ", "pid=", "name=", "'<unknown>'", "(",
               ")", ":", "9" * 30, "\t"]


def _make_kernel(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.7:
        return make_block(rng, KERNEL_SEEDS), pick(rng, ["kernel", "auto"])
    parts = [pick(rng, KERNEL_BAIT) for _ in range(rng.randint(1, 5))]
    line = "".join(parts) * rng.choice((10, 1000, 20000))   # a hostile line: the scan must stay linear
    return (pick(rng, KERNEL_SEEDS) + " " + line)[: mutate.TEXT_MAX * 2] + "\n", pick(rng, ["kernel", "auto"])


def parsed_values(text: str, fmt: str) -> list[tuple[Any, str, dict[str, Any]]]:
    """(record, metric, attrs) of every value the parsers of ``fmt`` read in ``text``, records checked."""
    parser = CompositeParser(fmt)
    records = parser.parse(Block(text, 1))
    _check_records(parser, records)
    return [(rec, metric, dict(attrs)) for rec in records for metric, _value, attrs in rec.values]


def _run_kernel(payload: tuple[str, str], work: Path) -> None:
    for _rec, metric, a in parsed_values(*payload):
        if metric == "hw_fault" and (a.get("class") not in ("hardware", "application", "unknown")
                                     or not isinstance(a.get("code"), (int, str)) or len(a.get("message", "")) > 240):
            raise AssertionError(f"bad fault {a!r}")


TARGETS = [
    Target("log_lines", _make_parse, _run_parse, (UnknownFormat,)),
    Target("kernel_lines", _make_kernel, _run_kernel),
    Target("hints", _make_hints, _run_hints),
    Target("logstream", _make_stream, _run_stream),
]

