"""Worker: the collectives of one steady training step of the tiny GPT under each strategy of ``--specs``, counted
by kind and group size (``CommCounter``) and the barriers (``torch.distributed.barrier`` patched); writes
rank<N>.json: ``{spec: {"counts": {"all_reduce@2": n, ...}, "barriers": n, "groups": optimizer param groups}}``.

Cases in a spec: ``hybrid3d:tp=2`` (worker settings as gpt_worker's specs), ``+clip`` appended: gradient clipping.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from gpt_worker import TINY, RecordingGPT, ShardedData, batch_ranks, build_strategy

from lightning_parallel.models import SyntheticTokens
from lightning_parallel.parallel.measure.comm_volume import CommCounter

COUNTED_STEP = 2  # after the first steps' one-time work (bucket layouts, mesh lookups)


class CountStep(pl.Callback):
    """Counts the collectives and barriers of batch ``COUNTED_STEP``, from its start to its end."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.barriers = 0
        self._counter: CommCounter | None = None
        self._barrier = dist.barrier

    def _counting_barrier(self, *args, **kwargs):
        self.barriers += 1
        return self._barrier(*args, **kwargs)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == COUNTED_STEP:
            dist.barrier = self._counting_barrier
            self._counter = CommCounter()
            self._counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == COUNTED_STEP and self._counter is not None:
            self._counter.__exit__(None, None, None)
            dist.barrier = self._barrier
            self.counts = dict(Counter(f"{e.kind}@{e.group_size}" for e in self._counter.events))


def count(spec: str, world: int) -> dict:
    pl.seed_everything(0, verbose=False)
    name, clip = spec.removesuffix("+clip"), spec.endswith("+clip")
    strategy = build_strategy(name)
    micro = 8 // batch_ranks(strategy, world)
    data = SyntheticTokens(num_samples=8 * 4, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    model = RecordingGPT(config=TINY, lr=1e-3, eps=1e-6)
    counter = CountStep()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=4,
        gradient_clip_val=1.0 if clip else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[counter],
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=ShardedData(data, micro))
    groups = len(trainer.optimizers[0].param_groups)  # ZeRO 1-2: one flat buffer each
    return {"counts": counter.counts, "barriers": counter.barriers, "groups": groups}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--specs", required=True, help="JSON list of strategy specs")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.set_num_threads(1)
    results = {spec: count(spec, world) for spec in json.loads(args.specs)}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
