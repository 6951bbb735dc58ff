"""Worker: short fits of the tiny GPT under several strategies in one launch, each with TrainingMonitor; writes
rank<N>.json with the monitor's summary and the measured step's collectives (and, under pp, the timeline).

Case keys: name, strategy (a spec as in gpt_worker.py: "ddp", "zero3", "hybrid3d:pp=2,pp_schedule=gpipe,..."),
steps (default 3), timeline (write the pipeline timeline into out/<name>).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import torch
from gpt_worker import TINY, ShardedData, batch_ranks, build_strategy

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel.callbacks.monitor import TrainingMonitor
from lightning_parallel.models import LitGPT, SyntheticTokens

GLOBAL_BATCH = 8


def run_case(case: dict, world: int, out: Path) -> dict:
    pl.seed_everything(0, verbose=False)
    steps = case.get("steps", 3)
    strategy = build_strategy(case["strategy"])
    dp = batch_ranks(strategy, world)
    data = SyntheticTokens(num_samples=GLOBAL_BATCH * steps, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    model = LitGPT(config=TINY, lr=1e-3)
    timeline_dir = out / case["name"] if case.get("timeline") else None
    monitor = TrainingMonitor(log_every_n_steps=1, measure_step=1, timeline_dir=timeline_dir)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[monitor],
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=ShardedData(data, GLOBAL_BATCH // dp))
    local = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.strategy.model.parameters()]
    local_param_bytes = sum(p.numel() * p.element_size() for p in local)
    return {
        "name": case["name"],
        "num_params": sum(p.numel() for p in LitGPT(config=TINY).parameters()),
        "local_param_bytes": local_param_bytes,  # this rank's (tensor-parallel shards, pipeline stages) at rest
        "micro_batch": GLOBAL_BATCH // dp,
        "summary": monitor.summary,
        "events": [asdict(e) for e in monitor.comm_events],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="JSON list of cases")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    results = [run_case(case, world, out) for case in json.loads(args.cases)]
    (out / f"rank{rank}.json").write_text(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
