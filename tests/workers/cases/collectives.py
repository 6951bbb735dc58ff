"""Case ``collectives`` (one per launch, ``--opts '{"specs": [...]}'``; tests/test_step_overhead.py): the collectives
of one steady training step of the tiny GPT under each strategy of ``specs``, counted by kind and group size
(``CommCounter``) and the barriers (``torch.distributed.barrier`` patched). Its result:
``{spec: {"counts": {"all_reduce@2": n, ...}, "barriers": n, "groups": optimizer param groups}}``.

Cases in a spec: ``hybrid3d:tp=2`` (cases/common.py's build_strategy), ``+clip`` appended: gradient clipping.
"""

from __future__ import annotations

from collections import Counter

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_parallel.models import SyntheticTokens
from lightning_parallel.parallel.measure.comm_volume import CommCounter

from .common import TINY, ShardedData, batch_ranks, build_strategy, make_trainer
from .models import RecordingGPT

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
    trainer = make_trainer(world, strategy, max_steps=4, gradient_clip_val=1.0 if clip else None, callbacks=[counter])
    trainer.fit(model, datamodule=ShardedData(data, micro))
    groups = len(trainer.optimizers[0].param_groups)  # ZeRO 1-2: one flat buffer each
    return {"counts": counter.counts, "barriers": counter.barriers, "groups": groups}


def run_case(case: dict, ctx) -> dict:
    return {spec: count(spec, ctx.world) for spec in case["specs"]}
