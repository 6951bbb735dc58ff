"""Case ``obs``: short fits of the tiny GPT under several strategies in one launch, each with TrainingMonitor: the
monitor's summary and the measured step's collectives (and, under pp, the timeline; tests/test_observability.py,
tests/test_overlap.py).

Case keys: name, strategy (a spec as cases/common.py's build_strategy takes: "ddp", "zero3",
"hybrid3d:pp=2,pp_schedule=gpipe,..."), steps (default 3), timeline (write the pipeline timeline into out/<name>).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import lightning.pytorch as pl

from lightning_parallel.callbacks.monitor import TrainingMonitor
from lightning_parallel.models import GPTModule, SyntheticTokens

from .common import TINY, ShardedData, batch_ranks, build_strategy, make_trainer

GLOBAL_BATCH = 8


def run_case(case: dict, ctx) -> dict:
    world, out = ctx.world, ctx.out
    pl.seed_everything(0, verbose=False)
    steps = case.get("steps", 3)
    strategy = build_strategy(case["strategy"])
    dp = batch_ranks(strategy, world)
    data = SyntheticTokens(num_samples=GLOBAL_BATCH * steps, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    model = GPTModule(config=TINY, lr=1e-3)
    timeline_dir = out / case["name"] if case.get("timeline") else None
    monitor = TrainingMonitor(log_every_n_steps=1, measure_step=1, timeline_dir=timeline_dir)
    trainer = make_trainer(world, strategy, max_steps=steps, callbacks=[monitor])
    trainer.fit(model, datamodule=ShardedData(data, GLOBAL_BATCH // dp))
    local = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.strategy.model.parameters()]
    local_param_bytes = sum(p.numel() * p.element_size() for p in local)
    result = {
        "name": case["name"],
        "num_params": sum(p.numel() for p in GPTModule(config=TINY).parameters()),
        "local_param_bytes": local_param_bytes,  # this rank's (tensor-parallel shards, pipeline stages) at rest
        "micro_batch": GLOBAL_BATCH // dp,
        "summary": monitor.summary,
        "events": [asdict(e) for e in monitor.comm_events],
    }
    return json.loads(json.dumps(result, default=str))  # what JSON cannot hold, as text
