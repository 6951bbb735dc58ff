"""Case ``collectives`` (one per launch, ``--opts '{"specs": [...]}'``; tests/test_step_overhead.py): the collectives
of one steady training step of the tiny GPT under each strategy of ``specs``, counted by kind and group size
(``CommCounter``) and the barriers (``torch.distributed.barrier`` patched). Its result:
``{spec: {"counts": {"all_reduce@2": n, ...}, "barriers": n, "groups": optimizer param groups}}``.

Cases in a spec: ``hybrid3d:tp=2`` (cases/common.py's build_strategy), then any of these appended: ``+clip``
gradient clipping, ``+bf16`` precision="bf16-mixed", ``+fp8`` / ``+fp8ag`` torchao float8 (without / with
float8 all-gather), ``+moe`` the GPT with a MoE block (8 experts, top-2). Each
result also has ``bytes`` (payload bytes by ``kind:dtype``), the ``router_bytes`` of one MoE router's weight, and the
dtypes of the local parameters and of the optimizer's states (``param_dtypes``, ``state_dtypes``).
"""

from __future__ import annotations

import dataclasses
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
        self.bytes: dict[str, int] = {}
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
            for e in self._counter.events:
                key = f"{e.kind}:{e.dtype}"
                self.bytes[key] = self.bytes.get(key, 0) + e.payload_bytes


def count(spec: str, world: int) -> dict:
    pl.seed_everything(0, verbose=False)
    name, *options = spec.split("+")
    config = dataclasses.replace(TINY, moe_experts=8, moe_top_k=2) if "moe" in options else TINY
    strategy = build_strategy(name)
    micro = 8 // batch_ranks(strategy, world)
    data = SyntheticTokens(num_samples=8 * 4, seq_len=config.seq_len, vocab_size=config.vocab_size)
    model = RecordingGPT(config=config, lr=1e-3, eps=1e-6)
    counter = CountStep()
    precision, plugins = "bf16-mixed" if "bf16" in options else "32-true", None
    if "fp8" in options or "fp8ag" in options:  # torchao float8 (tests/test_fp8_bytes.py), +fp8ag: float8 all-gather
        from lightning_parallel.plugins.float8 import Float8Precision

        precision, plugins = None, [Float8Precision(fsdp_float8_all_gather="fp8ag" in options, device="cpu")]
    trainer = make_trainer(
        world,
        strategy,
        max_steps=COUNTED_STEP + 1,
        gradient_clip_val=1.0 if "clip" in options else None,
        precision=precision,
        plugins=plugins,
        callbacks=[counter],
    )
    trainer.fit(model, datamodule=ShardedData(data, micro))
    optimizer = trainer.optimizers[0]
    groups = len(optimizer.param_groups)  # ZeRO 1-2: one flat buffer each
    states = {str(v.dtype) for state in optimizer.state.values() for v in state.values() if v.dim() > 0}
    return {
        "counts": counter.counts,
        "barriers": counter.barriers,
        "groups": groups,
        "bytes": counter.bytes,
        "router_bytes": config.moe_experts * config.d_model * 4,  # one router's fp32 weight (E, d)
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "state_dtypes": sorted(states),
    }


def run_case(case: dict, ctx) -> dict:
    return {spec: count(spec, ctx.world) for spec in case["specs"]}
