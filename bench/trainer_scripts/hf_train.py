"""A tiny Hugging Face Trainer run (CPU, fp32; on a GPU with fp16 mixed precision: --cuda-fp16) for the trainers
canary and the committed fixtures.

``python hf_train.py OUT [--fault STEP] [--logging-steps N] [--steps N] [--printer]``: trains a
one-layer GPT-2 made from a config (no download) on random tokens, writes TensorBoard event
files (``report_to="tensorboard"``: 4.x ``logging_dir=OUT/runs``, 5.x its default ``OUT/out/runs/<date>_<host>``), and prints what the
Trainer prints (run it with stdout and stderr sent to ``OUT/train.log``). ``--fault K`` makes
the embedding NaN just before optimizer step K (1-based, as HF counts ``global_step``): the loss
and every gradient are NaN from step K on, as after an fp16 overflow that reached the weights.
"""

import argparse
import inspect
import math
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PlantNaN(TrainerCallback):
    def __init__(self, step: int, out: str) -> None:
        self.step, self.out = step, out

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.step:  # the step about to run is number global_step + 1
            with torch.no_grad():
                model.transformer.wte.weight.fill_(math.nan)
            Path(self.out, "fault_at").write_text(f"{time.time()}\n")  # when (for the canary's seconds to page)


class Overflow(TrainerCallback):
    """A real fp16 overflow: the fp32 master weights stay finite, the fp16 activations of the
    scaled embedding do not, so GradScaler skips the step and halves its scale, step after step."""

    def __init__(self, step: int, out: str) -> None:
        self.step, self.out = step, out

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                model.transformer.wte.weight.mul_(1e6)
            Path(self.out, "fault_at").write_text(f"{time.time()}\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--fault", type=int, default=0)
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--printer", action="store_true", help="disable_tqdm: PrinterCallback instead of ProgressCallback")
    p.add_argument("--cuda-fp16", action="store_true", help="train on the GPU with fp16 mixed precision (GradScaler)")
    p.add_argument("--overflow", type=int, default=0,
                   help="at step K scale the embedding by 1e6: fp16 activations overflow, weights stay finite")
    a = p.parse_args()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    # 4.x takes logging_dir (here OUT/runs); 5.x dropped it: OUT/out/runs/<date>_<host>, or
    # $TENSORBOARD_LOGGING_DIR
    where = {"logging_dir": f"{a.out}/runs"} if "logging_dir" in inspect.signature(TrainingArguments).parameters else {}
    args = TrainingArguments(
        output_dir=f"{a.out}/out", max_steps=a.steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=a.logging_steps, report_to=["tensorboard"], save_strategy="no", use_cpu=not a.cuda_fp16, fp16=a.cuda_fp16,
        disable_tqdm=a.printer, seed=0, dataloader_num_workers=0, **where)
    callbacks = [PlantNaN(a.fault, a.out)] if a.fault else []
    callbacks += [Overflow(a.overflow, a.out)] if a.overflow else []
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(a.steps * 4, 16, 64), callbacks=callbacks)
    trainer.train()


if __name__ == "__main__":
    main()
