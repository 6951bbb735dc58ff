"""Case ``group_timeouts`` (one per launch): every process group a mesh strategy makes carries the run's timeout,
Lightning's default (30 minutes) when the strategy is given none, also where torch would give a new group less.

    run.py group_timeouts --opts '{"spec": "hybrid3d", "timeout": 77}' --out DIR    ("timeout": null: the default)

gloo here is given NCCL's default for new groups (10 minutes: torch's ``_get_default_timeout`` patched), so a group
made without the run's timeout shows. A short fit of the tiny GPT; when it starts, a side group of every rank is
made as the MoE pipeline makes its own (``ParallelMesh.side_group``), every role's group is looked up, and the
timeout of every group in torch's registry is reported: ``{"timeouts": [seconds, ...], "groups": n}``.
"""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import lightning.pytorch as pl
import torch.distributed as dist
from torch.distributed import distributed_c10d

from lightning_parallel import _compat
from lightning_parallel.models import SyntheticTokens
from lightning_parallel.parallel.mesh import MESH_AXES, ROLES

from .common import TINY, ShardedData, batch_ranks, build_strategy, make_trainer
from .models import RecordingGPT

NCCL_DEFAULT = timedelta(minutes=10)  # torch's default_pg_nccl_timeout


class ReadTimeouts(pl.Callback):
    def __init__(self) -> None:
        self.result: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        mesh = trainer.strategy.mesh
        mesh.side_group(list(range(dist.get_world_size())))
        for name in (*MESH_AXES, *ROLES):
            mesh.group(name)
        if mesh.dims.dpr > 1:
            mesh.hsdp_mesh()
        groups = _compat.process_groups()
        self.result = {"timeouts": [_compat.group_timeout(g).total_seconds() for g in groups], "groups": len(groups)}


def run_case(case: dict, ctx) -> dict:
    timeout = case.get("timeout")
    extra = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    strategy = build_strategy(case["spec"], **extra)
    reader = ReadTimeouts()
    data = SyntheticTokens(num_samples=8 * 2, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    loader = ShardedData(data, 8 // batch_ranks(strategy, ctx.world))
    with mock.patch.object(distributed_c10d, "_get_default_timeout", lambda backend: NCCL_DEFAULT):
        trainer = make_trainer(ctx.world, strategy, max_steps=1, callbacks=[reader])
        trainer.fit(RecordingGPT(config=TINY, lr=1e-3), datamodule=loader)
    return reader.result
