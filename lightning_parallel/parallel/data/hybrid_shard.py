"""HSDP: ZeRO 1-3 sharded inside a replica and replicated across replicas (``dp_shard``). Pure torch.

The data-parallel ranks split into ``dp / dp_shard`` replicas of ``dp_shard`` ranks each (the mesh's ``replicate``
and ``shard`` roles; replicas outermost, so a replica's ranks are neighbours, inside a node). Each replica holds the
whole model states sharded over its ranks, as plain ZeRO over ``dp_shard`` ranks would; the rank at the same place
in another replica holds the same shard. Gradients meet in two steps: reduced inside the replica (ZeRO-2/3 a
reduce-scatter, ZeRO-1 an all-reduce), then this rank's shard all-reduced across replicas, divided by the whole
data-parallel degree. Only the second step crosses nodes: one all-reduce of a shard, 1/dp_shard of the gradients.
Parameters are gathered inside the replica only.

- ZeRO-3: torch's FSDP2 on the 2-D (replicate, shard) mesh is HSDP (``fully_shard`` reduce-scatters over the
  shard dimension, then all-reduces over the replicate one: ``foreach_reduce`` in torch's ``_fully_shard``).
- ZeRO-1/2: :class:`HybridFlatZero`, the flat buffers of :mod:`~lightning_parallel.parallel.data.flat_zero` over
  the shard group, with the replica all-reduce of each shard added after the reduction, on the device (under
  offload the slice goes to the host only after it: on CUDA the groups are NCCL only). Under ZeRO-1 a
  parameter's whole ``.grad`` outside this rank's slice is its replica's mean only: the step and clipping read the
  slice, which is the whole data-parallel mean.

Checkpoints need nothing: replicas write identical pieces under the same names, which DCP saves once, and any
layout reads them back (the pieces are those of plain ZeRO over dp_shard ranks).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_parallel.parallel.data.flat_zero import FlatGroup, FlatZero, ShardGradients, ShardOptimizer
from lightning_parallel.parallel.data.fsdp import ShardParameters
from lightning_parallel.parallel.data.sharding import DataParallelSharding
from lightning_parallel.parallel.mesh import ParallelMesh


def check_hybrid_shard(config: Any) -> None:
    """Validate ``dp_shard`` against the other settings of a ParallelConfig, before any process starts.

    Raises:
        ValueError: naming the setting and the fix.
    """
    shard = config.dp_shard
    if shard is None:
        return
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
        raise ValueError(f"dp_shard={shard!r} is not a parallel degree: set dp_shard to a positive integer or None.")
    if isinstance(config.dp, int) and not isinstance(config.dp, bool) and config.dp % shard:
        raise ValueError(
            f"dp_shard={shard} must divide dp={config.dp} (HSDP: dp / dp_shard replicas, each sharded over dp_shard "
            f"ranks): choose dp_shard among the divisors of {config.dp}, or dp_shard=None to shard over all of dp."
        )
    refused = {  # setting -> (refused?, the fix)
        "zero_stage=0": (config.zero_stage == 0, "set zero_stage to 1, 2 or 3 (HSDP shards model states)"),
        f"ep={config.ep}": (config.ep > 1, "set ep=1 (experts would need replica groups of their own)"),
        "grad_compression='powersgd'": (
            config.grad_compression == "powersgd",
            "use grad_compression='none', 'bf16' or 'fp16'",
        ),
        "overlap_grad_reduce=True": (config.overlap_grad_reduce is True, "set overlap_grad_reduce=False"),
    }
    for setting, (bad, fix) in refused.items():
        if bad:
            raise ValueError(f"dp_shard={shard} (HSDP) with {setting} is not supported: {fix}, or set dp_shard=None.")


class _Hybrid:
    """What every HSDP stage adds: the replicas' mesh, and the divisor over every data-parallel rank."""

    replicate_mesh: DeviceMesh

    @classmethod
    def from_mesh(cls, mesh: ParallelMesh, **settings: Any) -> DataParallelSharding:
        sharding = cls(mesh["shard"], expert_mesh=mesh["expert_shard"], **settings)  # type: ignore[call-arg]
        sharding.replicate_mesh = mesh["replicate"]
        sharding.hsdp = mesh.hsdp_mesh()
        return sharding

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        return self.replicate_mesh.get_group()

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.size() * self.replicate_mesh.size()  # type: ignore[attr-defined]


class HybridShardParameters(_Hybrid, ShardParameters):
    """ZeRO-3 under HSDP: FSDP2 units on the 2-D (replicate, shard) mesh."""

    summary = ShardParameters.summary + ", HSDP: replicated across dp / dp_shard replicas"

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        return self.hsdp

    def shard_module(self, root: nn.Module, units: list[str] | None = None) -> list[str]:
        made = super().shard_module(root, units)
        # sum both steps and divide once after, on every device: CUDA then runs the arithmetic the CPU tests check
        # (FSDP2 would otherwise average each step, NCCL's AVG, never run here); see fsdp.py for why
        for path in made:
            root.get_submodule(path).set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        return made


class HybridFlatZero(FlatZero):
    """ZeRO-1/2's flat buffers sharded over ``group`` (one replica's ranks), each shard all-reduced over
    ``replicate_group`` after the replica's reduction, gradients divided by every data-parallel rank."""

    def __init__(self, optimizer: Optimizer, group: dist.ProcessGroup, stage: int, **kwargs: Any) -> None:
        self.replicate_group: dist.ProcessGroup = kwargs.pop("replicate_group")
        self.divisor = dist.get_world_size(group) * dist.get_world_size(self.replicate_group)
        super().__init__(optimizer, group, stage, **kwargs)

    def _flat_group(self, params: list[nn.Parameter], expert: int) -> FlatGroup:
        fg = super()._flat_group(params, expert)
        fg.divisor = self.divisor  # the replica's sum divided by every data-parallel rank; replicas then add up
        return fg

    def _deliver(self, fg: FlatGroup, grad: Tensor) -> None:
        # the replica all-reduce runs on the replica's slice while it is still on the device, before offload copies
        # it to the host: on CUDA the replicate group is NCCL only and has no backend for host tensors
        wire = self.wire_dtype if self.wire_dtype not in (None, grad.dtype) else None
        sent = grad.to(wire) if wire is not None else grad
        dist.all_reduce(sent, group=self.replicate_group)  # the only collective that crosses replicas
        if wire is not None:
            grad.copy_(sent)
        super()._deliver(fg, grad)


class _HybridFlat(_Hybrid):
    def shard_optimizer(self, optimizer: Optimizer) -> None:
        DataParallelSharding.shard_optimizer(self, optimizer)  # type: ignore[arg-type]
        self._flat[id(optimizer)] = HybridFlatZero(  # type: ignore[attr-defined]
            optimizer,
            self.group,  # type: ignore[attr-defined]
            self.stage,  # type: ignore[attr-defined]
            offload=self.offload,  # type: ignore[attr-defined]
            wire_dtype=self.wire_dtype,  # type: ignore[attr-defined]
            replicate_group=self.replicate_group,
        )


class HybridShardOptimizer(_HybridFlat, ShardOptimizer):
    summary = ShardOptimizer.summary + ", HSDP"


class HybridShardGradients(_HybridFlat, ShardGradients):
    summary = ShardGradients.summary + ", HSDP"


HYBRID_STAGES: dict[int, type[DataParallelSharding]] = {
    cls.stage: cls for cls in (HybridShardOptimizer, HybridShardGradients, HybridShardParameters)
}


def replica_bytes(grad_bytes: float, dp_shard: int, replicas: int) -> float:
    """Bytes one rank sends across replicas per step: a ring all-reduce of its shard, 2 (g / dp_shard) (r-1)/r."""
    return 2 * grad_bytes / dp_shard * (replicas - 1) / replicas if replicas > 1 else 0.0
