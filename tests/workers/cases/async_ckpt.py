"""Case ``async_ckpt``: the tiny GPT trained with periodic checkpoints (ModelCheckpoint, save_last) written sync or
async (conftest's ``Batch``, ``worker="async_ckpt"``; tests/test_async_checkpoint.py).

Case keys: name, steps, async (the strategy's async_save), dir (the checkpoint folder: a path or a URL: file://,
memory://),
every (save every n steps; 0: no ModelCheckpoint), resume (ckpt_path for fit: a folder or "last"), slow_write
(seconds each written item of the saves after the first sleeps: a write still in flight), kill_at (this global
step's end: SIGKILL this process while the save of that step is in flight). Records the losses, how many saves
were staged asynchronously and this rank's global step at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import lightning.pytorch as pl
import torch.distributed.checkpoint.filesystem as dcp_fs
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.models import SyntheticTokens

from .common import TINY, ShardedData, batch_ranks, build_strategy, make_trainer
from .models import RecordingGPT

GLOBAL_BATCH = 16
EPOCH_STEPS = 2  # saves every 2 steps fall at epochs' ends: a resume starts the next epoch where training did


class KillDuringSave(pl.Callback):
    """Once the save of step ``step`` is in flight (its writes are slowed), SIGKILL this process."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:  # ModelCheckpoint saves after every batch_end hook
        checkpointer = trainer.strategy.async_checkpointer(create=False)
        if trainer.global_step == self.step and checkpointer is not None and checkpointer.in_flight:
            time.sleep(0.5)  # part of the shards written
            os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def slow_writes(seconds: float):
    """Every item written after the first save's sleeps ``seconds`` first."""
    original, saves = dcp_fs._write_item, []

    def write_item(*args, **kwargs):
        if saves:
            time.sleep(seconds)
        return original(*args, **kwargs)

    original_finish = dcp_fs.FileSystemWriter.finish

    def finish(self, *args, **kwargs):
        saves.append(1)
        return original_finish(self, *args, **kwargs)

    if seconds:
        dcp_fs._write_item, dcp_fs.FileSystemWriter.finish = write_item, finish
    try:
        yield
    finally:
        dcp_fs._write_item, dcp_fs.FileSystemWriter.finish = original, original_finish


def run_case(case: dict, ctx) -> dict:
    spec, world = ctx.strategy, ctx.world
    pl.seed_everything(0, verbose=False)
    strategy = build_strategy(spec, async_save=bool(case.get("async")))  # 'zero2' or 'hybrid3d:tp=2,...'
    dp = batch_ranks(strategy, world)
    data = SyntheticTokens(num_samples=GLOBAL_BATCH * EPOCH_STEPS, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    model = RecordingGPT(config=TINY, lr=1e-3, eps=1e-6)
    callbacks: list[pl.Callback] = []
    if case.get("every"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=case["dir"],
                every_n_train_steps=case["every"],
                save_last=True,
                monitor="step",
                mode="max",
                save_top_k=case.get("keep", -1),
                enable_version_counter=False,
            )
        )
    if case.get("kill_at"):
        callbacks.append(KillDuringSave(case["kill_at"]))
    trainer = make_trainer(
        world, strategy, max_steps=case["steps"], enable_checkpointing=bool(case.get("every")), callbacks=callbacks
    )
    resume = case.get("resume")
    if resume == "last":
        resume = case["dir"].rstrip("/") + "/last.ckpt"  # a path or a URL
    with slow_writes(case.get("slow_write", 0)):
        trainer.fit(model, datamodule=ShardedData(data, GLOBAL_BATCH // dp), ckpt_path=resume)
    checkpointer = trainer.strategy.async_checkpointer(create=False)
    return {"name": case["name"], "losses": model.losses, "step": trainer.global_step, "closed": checkpointer is None}
