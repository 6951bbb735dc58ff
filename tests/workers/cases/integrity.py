"""Case ``integrity``: the tiny GPT under one strategy for a list of cases that save, resume and fail
(tests/test_checkpoint_integrity.py).

Case keys: name, steps, config ("tiny", "deep": 6 blocks, "wide": d_model 64), resume (ckpt_path for fit),
expect_error (record the exception instead of failing), save (a sharded checkpoint after fit), enospc_rank
(during that save, this rank's disk is "full" half-way through its shard: OSError(ENOSPC)). Every case
records a checksum of this rank's parameters (after the error, for a failed fit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os

import lightning.pytorch as pl
import torch.distributed.checkpoint.filesystem as dcp_fs

from lightning_parallel.models import SyntheticTokens

from .common import DEEP, TINY, ShardedData, batch_ranks, build_strategy, make_trainer, save_full_params
from .models import RecordingGPT

CONFIGS = {"tiny": TINY, "deep": DEEP, "wide": dataclasses.replace(TINY, d_model=64)}
GLOBAL_BATCH = 16


@contextlib.contextmanager
def full_disk(active: bool):
    """The second item written into this rank's shard hits a full disk after a few bytes."""
    original, calls = dcp_fs._write_item, []

    def write_item(transforms, stream, data, write_item, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            stream.write(b"\0" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(transforms, stream, data, write_item, *args, **kwargs)

    if active:
        dcp_fs._write_item = write_item
    try:
        yield
    finally:
        dcp_fs._write_item = original


def checksum(trainer: pl.Trainer) -> float:
    total = 0.0
    for p in trainer.strategy.model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.detach().double().abs().sum().item() + local.detach().double().sum().item()
    return total


def run_case(case: dict, ctx) -> dict:
    strategy, world, rank, out = ctx.strategy, ctx.world, ctx.rank, ctx.out
    pl.seed_everything(0, verbose=False)
    config = CONFIGS[case.get("config", "tiny")]
    strategy_obj = build_strategy(strategy)
    dp = batch_ranks(strategy_obj, world)
    data = SyntheticTokens(num_samples=GLOBAL_BATCH * 8, seq_len=config.seq_len, vocab_size=config.vocab_size)
    model = RecordingGPT(config=config, lr=1e-3, eps=1e-6)
    trainer = make_trainer(world, strategy_obj, max_steps=case["steps"])
    result: dict = {"name": case["name"]}
    try:
        trainer.fit(model, datamodule=ShardedData(data, GLOBAL_BATCH // dp), ckpt_path=case.get("resume"))
    except Exception as err:  # noqa: BLE001
        if not case.get("expect_error"):
            raise
        result.update(error=f"{type(err).__name__}: {err}", checksum=checksum(trainer))
        return result
    result["checksum"] = checksum(trainer)
    save_full_params(trainer, model, out / f"{case['name']}_params.pt")
    if case.get("save"):
        with full_disk(case.get("enospc_rank") == rank):
            try:
                trainer.save_checkpoint(case["save"])
            except OSError as err:
                result["save_error"] = f"{type(err).__name__}: {err}"
                result["save_errno"] = err.errno
    return result
