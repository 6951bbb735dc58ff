"""Case ``fault_tolerance``: one torchft replica group, Hybrid3DStrategy with ``fault_tolerance='torchft'``
(tests/test_torchft.py starts each group as its own ``torchrun --nproc-per-node 2 run.py fault_tolerance``, as
torchft expects). Its batches are a function of (step, replica group, dp rank), so the test can rebuild in one
process what every step averaged, whichever groups its quorum held.

Case keys: replica, lighthouse (its address), steps, zero_stage, sleep (seconds a step while the group is alone in
its quorum, so that a (re)starting group joins before max_steps), dir (the folder both groups share), no_wait (a
restarted group: it does not wait for the other at its first step; the groups otherwise start together).
Every rank appends ``<step> <groups in the quorum> <pid>`` to ``DIR/replica<R>_rank<N>.log`` after each step
(step: the committed steps so far); rank 0 saves the final parameters to ``DIR/replica<R>.pt``. Returns this rank's
global step at the end.
"""

from __future__ import annotations

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
        # both groups start together (as a scheduler would start them); a restarted one (no_wait) does not wait
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


def run_case(case: dict, ctx) -> dict:
    replica, out = case["replica"], Path(case["dir"])
    strategy = Hybrid3DStrategy(
        zero_stage=case.get("zero_stage", 0),
        fault_tolerance="torchft",
        ft_replicas=2,
        ft_replica_id=replica,
        ft_lighthouse=case["lighthouse"],
        ft_timeout=30.0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=case.get("steps", 40),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    module = StepKeyed(replica, out, case.get("sleep", 0.0), case.get("no_wait", False))
    trainer.fit(module)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.net.state_dict().items()}, out / f"replica{replica}.pt")
    return {"global_step": trainer.global_step}
