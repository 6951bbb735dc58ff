"""Worker: the tiny GPT under one strategy for a list of cases that save, resume and fail; writes rank<N>.json.

Case keys: name, steps, config ("tiny", "deep": 6 blocks, "wide": d_model 64), resume (ckpt_path for fit),
expect_error (record the exception instead of failing), save (a sharded checkpoint after fit), enospc_rank
(during that save, this rank's disk is "full" half-way through its shard: OSError(ENOSPC)). Every case
records a checksum of this rank's parameters (after the error, for a failed fit).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from gpt_worker import DEEP, TINY, RecordingGPT, ShardedData, batch_ranks, build_strategy

from lightning_parallel.models import SyntheticTokens

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


def run_case(case: dict, strategy: str, world: int, rank: int, out: Path) -> dict:
    pl.seed_everything(0, verbose=False)
    config = CONFIGS[case.get("config", "tiny")]
    strategy_obj = build_strategy(strategy)
    dp = batch_ranks(strategy_obj, world)
    data = SyntheticTokens(num_samples=GLOBAL_BATCH * 8, seq_len=config.seq_len, vocab_size=config.vocab_size)
    model = RecordingGPT(config=config, lr=1e-3, eps=1e-6)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy_obj,
        max_steps=case["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    result: dict = {"name": case["name"]}
    try:
        trainer.fit(model, datamodule=ShardedData(data, GLOBAL_BATCH // dp), ckpt_path=case.get("resume"))
    except Exception as err:  # noqa: BLE001
        if not case.get("expect_error"):
            raise
        result.update(error=f"{type(err).__name__}: {err}", checksum=checksum(trainer))
        return result
    result["checksum"] = checksum(trainer)
    state = trainer.strategy.full_state_dict()  # gathered in the single-process format
    if rank == 0:
        torch.save(state, out / f"{case['name']}_params.pt")
    if case.get("save"):
        with full_disk(case.get("enospc_rank") == rank):
            try:
                trainer.save_checkpoint(case["save"])
            except OSError as err:
                result["save_error"] = f"{type(err).__name__}: {err}"
                result["save_errno"] = err.errno
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of cases")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    results = [run_case(case, args.strategy, world, rank, out) for case in json.loads(args.cases)]
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
