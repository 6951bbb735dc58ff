"""Case ``async_ps``: the tiny GPT under strategy='async_ps' (or the single-process reference)
(tests/test_async_ps.py; ``make bench``'s async section, benchmarks/async_ps.py).

Each worker records its own loss per step (its share of the global batch: the mean over the workers is the
global batch's loss) and each validation loss; rank 0 (and the reference) save the final parameters to
``OUT/params.pt``; a server records its counters. Case keys (:class:`Settings`): reference (one process, the whole
global batch), num_servers, staleness, steps, global_batch, clip, lr, slow_sleep, val_every, kill_rank and kill_step
(rank R kills itself with SIGKILL in the forward of its step K: after its pull, before its push), ckpt_dir (a
checkpoint every ckpt_every steps), resume (fit from that checkpoint), epoch_steps (batches per epoch; 0: steps),
max_seconds (each worker's wall budget for training), d_model. ``APS_DEBUG=SECONDS`` in the environment: dump every
thread's stack and exit after that long (a hang's diagnosis).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel import AsyncPSStrategy
from lightning_parallel.models import GPTConfig, GPTModule, SyntheticTokens

TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)


@dataclasses.dataclass(frozen=True)
class Settings:
    reference: bool = False
    num_servers: int = 1
    staleness: int = 0
    steps: int = 10
    global_batch: int = 8
    clip: float | None = None
    lr: float = 3e-3
    slow_sleep: float = 0.0
    val_every: int = 0
    kill_rank: int = -1
    kill_step: int = -1
    ckpt_dir: str | None = None
    ckpt_every: int = 5
    resume: str | None = None
    epoch_steps: int = 0
    max_seconds: float | None = None
    d_model: int = 32


def setup() -> None:
    if os.environ.get("APS_DEBUG"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["APS_DEBUG"]), exit=True)


class Recording(GPTModule):
    def __init__(self, kill_rank: int, kill_step: int, config: GPTConfig = TINY, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.kill_rank, self.kill_step = kill_rank, kill_step
        self.losses: list[tuple[int, float]] = []
        self.val_losses: list[tuple[int, float]] = []

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.kill_rank and self.trainer.global_step == self.kill_step:
            print(f"KILLING rank {self.global_rank} at step {self.kill_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().training_step(batch, batch_idx)
        self.losses.append((self.trainer.global_step, loss.item()))
        return loss

    def on_validation_epoch_end(self) -> None:
        value = self.trainer.callback_metrics.get("val_loss")
        if value is not None:
            self.val_losses.append((self.trainer.global_step, float(value)))


class WallBudget(pl.Callback):
    """Each worker stops by itself once ``seconds`` have passed since its training began (no collective)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if time.perf_counter() - self.start > self.seconds:
            trainer.should_stop = True


@torch.no_grad()
def val_loss(model: GPTModule, data) -> float:
    """The mean loss over the whole validation set with the model's current (final) parameters."""
    model.eval()
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.stack([data[i][1] for i in range(len(data))])
    losses = [model.loss(model(x[i : i + 16]), y[i : i + 16]).item() for i in range(0, len(data), 16)]
    return sum(losses) / len(losses)


class Data(pl.LightningDataModule):
    def __init__(self, global_batch: int, steps: int) -> None:
        super().__init__()
        self.global_batch = global_batch
        size = {"seq_len": TINY.seq_len, "vocab_size": TINY.vocab_size}
        self.train = SyntheticTokens(num_samples=global_batch * steps, **size)  # steps: batches per epoch
        self.val = SyntheticTokens(num_samples=64, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size, split=1)

    def _loader(self, data, shuffle: bool) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(data, shuffle=shuffle, seed=0, **kwargs)
        return DataLoader(data, batch_size=self.global_batch // kwargs["num_replicas"], sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val, shuffle=False)


def run_case(case: dict, ctx) -> dict:
    args = Settings(**case)
    pl.seed_everything(0, verbose=False)
    model = Recording(args.kill_rank, args.kill_step, dataclasses.replace(TINY, d_model=args.d_model), lr=args.lr)
    if args.reference:
        strategy, devices = "auto", 1
    else:
        strategy = AsyncPSStrategy(
            num_servers=args.num_servers, staleness=args.staleness, slow_worker_sleep=args.slow_sleep
        )
        devices = ctx.world
    callbacks: list = [WallBudget(args.max_seconds)] if args.max_seconds else []
    if args.ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        gradient_clip_val=args.clip,
        logger=False,
        enable_checkpointing=args.ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        val_check_interval=args.val_every or None,
        check_val_every_n_epoch=None if args.val_every else 1,
        log_every_n_steps=1,
        callbacks=callbacks,
        use_distributed_sampler=False,
    )
    data = Data(args.global_batch, args.epoch_steps or args.steps)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    wall = time.perf_counter() - start
    rank = trainer.global_rank
    is_server = isinstance(trainer.strategy, AsyncPSStrategy) and trainer.strategy.is_server
    result = {
        "rank": rank,
        "role": "server" if is_server else "worker",
        "global_step": trainer.global_step,
        "losses": model.losses,
        "val_losses": model.val_losses,
        "counters": getattr(trainer.strategy, "counters", None),
        "fit_seconds": wall,
    }
    if rank == 0 and args.max_seconds:
        result["final_val_loss"] = val_loss(model, data.val)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(ctx.out) / "params.pt")
    return result
