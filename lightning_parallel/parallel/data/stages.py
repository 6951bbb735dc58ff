"""The table of data-parallel shardings, one row per ZeRO stage: ``zero_stage`` (or a ``zero*`` strategy name)
picks a row here, and nothing else compares stage numbers. Pure torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_parallel.parallel.data.flat_zero import ShardGradients, ShardOptimizer
from lightning_parallel.parallel.data.fsdp import ShardParameters
from lightning_parallel.parallel.data.hybrid_shard import HYBRID_STAGES
from lightning_parallel.parallel.data.replicate import Replicate
from lightning_parallel.parallel.data.sharding import DataParallelSharding
from lightning_parallel.parallel.mesh import ParallelMesh

if TYPE_CHECKING:  # config.py imports this module's checks
    from lightning_parallel.parallel.config import ParallelConfig

ZERO_STAGES: dict[int, type[DataParallelSharding]] = {
    cls.stage: cls for cls in (Replicate, ShardOptimizer, ShardGradients, ShardParameters)
}
OFFLOAD_STAGES = tuple(stage for stage, cls in ZERO_STAGES.items() if cls.supports_offload)


def zero_stage(stage: int) -> type[DataParallelSharding]:
    """The sharding class of a (validated) stage number."""
    return ZERO_STAGES[stage]


def check_zero_settings(stage: object, offload: object, *, name: str = "stage", allow_zero: bool = False) -> None:
    """Validate a ZeRO stage and offload flag before anything starts."""
    stages = [s for s in ZERO_STAGES if allow_zero or s > 0]
    if isinstance(stage, bool) or stage not in stages:
        choices = ", ".join(str(s) for s in stages[:-1]) + f" or {stages[-1]}"
        raise ValueError(f"{name}={stage!r} is not a ZeRO stage: set {name} to {choices}.")
    if not isinstance(offload, bool):
        raise TypeError(f"offload={offload!r} must be True or False: set offload=True or offload=False.")
    if offload and stage not in OFFLOAD_STAGES:
        options = " or ".join(f"{name}={s}" for s in OFFLOAD_STAGES)
        raise ValueError(
            f"offload=True needs sharded gradients, which {name}={stage} does not have (ZeRO-Offload "
            f"builds on stage 2): set {options}, or offload=False."
        )


def make_sharding(config: ParallelConfig, mesh: ParallelMesh, setting: str = "") -> DataParallelSharding:
    """The sharding of ``config.zero_stage`` over the world's ``mesh`` (it picks the roles it shards over; HSDP's
    variant when the mesh has replicas), with the config's data-parallel settings."""
    cls = HYBRID_STAGES[config.zero_stage] if mesh.dims.dpr > 1 else zero_stage(config.zero_stage)
    return cls.from_mesh(
        mesh,
        offload=config.offload,
        reshard_after_forward=config.reshard_after_forward,
        grad_compression=config.grad_compression,
        powersgd_rank=config.powersgd_rank,
        overlap_grad_reduce=config.overlap_grad_reduce,
        bucket_mb=config.bucket_mb,
        setting=setting,
    )
