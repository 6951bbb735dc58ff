"""HSDP (``dp_shard``): ZeRO 1-3 sharded inside a replica and replicated across replicas. Pure torch.

The data-parallel ranks split into ``dp / dp_shard`` replicas of ``dp_shard`` ranks each (the mesh's ``replicate``
and ``shard`` roles; replicas outermost, so a replica's ranks are neighbours, inside a node). Each replica holds the
whole model states sharded over its ranks, as plain ZeRO over ``dp_shard`` ranks would; the rank at the same place
in another replica holds the same shard. Gradients meet in two steps: reduced inside the replica (ZeRO-2/3 a
reduce-scatter, ZeRO-1 an all-reduce), then this rank's shard all-reduced across replicas, divided by the whole
data-parallel degree. Only the second step crosses nodes: one all-reduce of a shard, 1/dp_shard of the gradients.
Parameters are gathered inside the replica only.

HSDP is a property of the mesh (its ``dpr`` axis, the ``replicate`` role), not a class of its own: every sharding
is built with the 2-D (replicate, shard) mesh when the mesh has replicas (``DataParallelSharding.from_mesh``) and
divides by every data-parallel rank.

- ZeRO-3 (:class:`~lightning_parallel.parallel.data.fsdp.ShardParameters`): torch's FSDP2 on the 2-D mesh is HSDP.
- ZeRO-1/2 (:class:`~lightning_parallel.parallel.data.flat_zero.FlatZero` with a ``replicate_group``): the flat
  buffers over the shard group, with the replica all-reduce of each shard added after the reduction, on the device
  (under offload the slice goes to the host only after it: on CUDA the groups are NCCL only). Under ZeRO-1 a
  parameter's whole ``.grad`` outside this rank's slice is its replica's mean only: the step and clipping read the
  slice, which is the whole data-parallel mean.
- ZeRO-0 has nothing to shard (``supports_hsdp = False``); ``ParallelConfig`` refuses it, and the other settings
  HSDP does not support, before any process starts.

Checkpoints need nothing: replicas write identical pieces under the same names, which DCP saves once, and any
layout reads them back (the pieces are those of plain ZeRO over dp_shard ranks).
"""

from __future__ import annotations


def replica_bytes(grad_bytes: float, dp_shard: int, replicas: int) -> float:
    """Bytes one rank sends across replicas per step: a ring all-reduce of its shard, 2 (g / dp_shard) (r-1)/r."""
    return 2 * grad_bytes / dp_shard * (replicas - 1) / replicas if replicas > 1 else 0.0
