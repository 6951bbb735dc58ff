"""Worker: one torchft replica group (run under ``torchrun --nproc-per-node 2``), Hybrid3DStrategy with
``fault_tolerance='torchft'``. Its batches are a function of (step, replica group, dp rank), so the test can
rebuild in one process what every step averaged, whichever groups its quorum held.

Every rank appends ``<step> <groups in the quorum> <pid>`` to ``OUT/replica<R>_rank<N>.log`` after each step
(step: the committed steps so far). A group alone in its quorum sleeps ``--sleep`` seconds a step, so that a
(re)starting group joins before max_steps; the groups start their first step together (not with --no-wait).
Rank 0 saves the final parameters to ``OUT/replica<R>.pt``.

    --replica R  --lighthouse http://HOST:PORT  --steps S  --zero-stage Z  --sleep SECONDS  --out DIR  [--no-wait]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_parallel import Hybrid3DStrategy

DIM, BATCH = 8, 4


def batch_of(step: int, replica: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch dp rank ``rank`` of replica group ``replica`` trains on at ``step`` (the same on a restart)."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * replica + rank)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # momentum: optimizer state must travel on a rejoin


class StepKeyed(pl.LightningModule):
    def __init__(self, replica: int, out: Path, sleep: float, no_wait: bool) -> None:
        super().__init__()
        self.net, self.replica, self.out, self.sleep, self.no_wait = model(), replica, out, sleep, no_wait

    def training_step(self, batch, batch_idx):
        # alone: slow, so that the other group (re)joins in time; together: slow enough for the test to kill at a step
        time.sleep(self.sleep if self.trainer.strategy.replicas.participants < 2 else 0.05)
        x, y = batch_of(self.global_step, self.replica, self.trainer.strategy.mesh.rank("batch"))
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        # both groups start together (as a scheduler would start them); a restarted one (--no-wait) does not wait
        (self.out / f"ready{self.replica}_{self.global_rank}").touch()
        while not self.no_wait and not (self.out / f"ready{1 - self.replica}_{self.global_rank}").exists():
            time.sleep(0.05)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        replicas = self.trainer.strategy.replicas
        with open(self.out / f"replica{self.replica}_rank{self.global_rank}.log", "a") as f:
            f.write(f"{replicas.step} {replicas.participants} {os.getpid()}\n")

    def configure_optimizers(self):
        return optimizer(self.parameters())

    def train_dataloader(self):
        return DataLoader(range(100_000), batch_size=1)  # a clock only: the batches are batch_of's


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-wait", action="store_true")
    a = p.parse_args()
    strategy = Hybrid3DStrategy(
        zero_stage=a.zero_stage,
        fault_tolerance="torchft",
        ft_replicas=2,
        ft_replica_id=a.replica,
        ft_lighthouse=a.lighthouse,
        ft_timeout=30.0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=a.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    module = StepKeyed(a.replica, a.out, a.sleep, a.no_wait)
    trainer.fit(module)
    if trainer.global_rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in module.net.state_dict().items()}, a.out / f"replica{a.replica}.pt"
        )


if __name__ == "__main__":
    main()
