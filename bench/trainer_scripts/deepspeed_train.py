"""A tiny DeepSpeed run (CPU, fp32, ZeRO 0, one process) for the trainers canary and the fixtures.

``python deepspeed_train.py OUT [--fault STEP] [--steps N]``: an MLP trained through
``deepspeed.initialize`` with ``steps_per_print: 1``; the script prints ``step N loss X`` as
users do (DeepSpeed itself prints no loss). fp16 needs a GPU: on CPU the run is fp32, so its
own loss-scaler messages cannot appear (the fixtures cover them from DeepSpeed's source).
``--fault K`` makes the first layer NaN before step K (1-based, as DeepSpeed counts ``global_steps``).
"""

import argparse
import math
import os
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--fault", type=int, default=0)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import deepspeed
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    cfg = {"train_batch_size": 4, "steps_per_print": 1, "zero_optimization": {"stage": 0}}
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(0)
    for step in range(1, a.steps + 1):
        if step == a.fault:
            with torch.no_grad():
                net[0].weight.fill_(math.nan)
            Path(a.out, "fault_at").write_text(f"{time.time()}\n")
        x = torch.randn(4, 8, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(1, keepdim=True) * 0.1)
        engine.backward(loss)
        engine.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
