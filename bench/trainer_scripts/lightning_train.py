"""A tiny Lightning run (CPU, fp32) for the trainers canary and the committed fixtures.

``python lightning_train.py OUT [--fault STEP] [--steps N]``: trains a two-layer MLP on random
data for one epoch of ``--steps`` batches, logging ``train_loss`` (step and epoch) to the progress
bar, a TensorBoardLogger and a CSVLogger under ``OUT/lightning_logs`` (``version_0``). The
progress bar is rich's when ``rich`` is installed, else tqdm's (run it with stdout and stderr
sent to ``OUT/train.log``). ``--fault K`` makes the first layer's weight NaN just before the
training step at ``global_step == K`` (the step Lightning's loggers record for it): the loss is
NaN from that step on.
"""

import argparse
import math
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger


class Net(L.LightningModule):
    def __init__(self, fault: int, out: str) -> None:
        super().__init__()
        self.fault, self.out = fault, out
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        if self.fault and self.global_step == self.fault:
            with torch.no_grad():
                self.net[0].weight.fill_(math.nan)
            Path(self.out, "fault_at").write_text(f"{time.time()}\n")  # when (for the canary's seconds to page)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--fault", type=int, default=0)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.steps * 4, 8, generator=g)
    y = x.sum(1, keepdim=True) * 0.1
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    loggers = [TensorBoardLogger(a.out, name="lightning_logs", version=0),
               CSVLogger(a.out, name="lightning_logs", version=0)]
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=loggers, log_every_n_steps=1,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Net(a.fault, a.out), data)


if __name__ == "__main__":
    main()
