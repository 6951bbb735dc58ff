"""One rank of a world of any size, in this process: torch's fake process group, the layout's mesh and sharding,
and where each of the mesh's process groups sits (its axes, its ranks, the stride between them).

torch's ``fake`` backend answers every collective at once without moving data, for any rank of any world size, so
the mesh of a 1,024-rank job builds here as it does on rank ``r`` of the cluster: the same ``ParallelDims``,
``ParallelMesh`` and sharding the strategies build (:func:`open_rank`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from lightning_parallel._compat import resolve_group
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.sharding import DataParallelSharding
from lightning_parallel.parallel.data.stages import make_sharding
from lightning_parallel.parallel.mesh import MESH_AXES, ParallelDims, ParallelMesh
from lightning_parallel.plugins.precision import param_dtype_for


@dataclass(frozen=True)
class GroupInfo:
    """A process group of the mesh as one rank sees it.

    Attributes:
        axes: the mesh axes it spans, joined by ``_`` (``dp_ep``), ``world``, or ``other`` (not the mesh's).
        ranks: its members, global ranks in order.
        stride: global ranks between neighbouring members (what decides whether it stays inside a node).
    """

    axes: str
    ranks: tuple[int, ...]
    stride: int

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class SimulatedWorld:
    """What the strategies build for one rank before the model: the degrees, the mesh, the sharding."""

    rank: int
    dims: ParallelDims
    mesh: ParallelMesh
    sharding: DataParallelSharding

    def groups(self) -> dict[str, GroupInfo]:
        return mesh_groups(self.mesh)


def mesh_groups(mesh: ParallelMesh) -> dict[str, GroupInfo]:
    """Process group name -> :class:`GroupInfo`, for every group ``mesh`` made so far (flattened roles too), on
    any backend (a real run's trace names its groups the same way)."""
    out: dict[str, GroupInfo] = {}
    strides = axis_strides(mesh.dims)
    for name, axes in mesh.group_axes().items():
        ranks = tuple(dist.get_process_group_ranks(resolve_group(name)))
        stride = 1 if axes == "world" else min(strides.get(a, 1) for a in axes.split("_"))
        out[name] = GroupInfo(axes, ranks, stride)
    return out


def axis_strides(dims: ParallelDims) -> dict[str, int]:
    """Global ranks between neighbours along each mesh axis (axes outermost first: the last one has stride 1)."""
    sizes = [dims.degrees[a] for a in MESH_AXES]
    return {axis: math.prod(sizes[i + 1 :]) for i, axis in enumerate(MESH_AXES)}


def rank_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """This rank's index along every mesh axis."""
    strides = axis_strides(dims)
    return {axis: rank // strides[axis] % dims.degrees[axis] for axis in MESH_AXES}


@contextmanager
def open_rank(
    config: ParallelConfig, world_size: int, rank: int, precision: str = "bf16-mixed"
) -> Iterator[SimulatedWorld]:
    """Rank ``rank`` of ``world_size`` on torch's fake process group, with the mesh and sharding of ``config``
    (validated) and ZeRO-3's gather dtype under ``precision`` (as the strategies pick it); the process group is
    destroyed on exit. One rank per process: DTensor's caches compare meshes by shape and ranks, not by process
    group, and would hand a second rank the first one's groups (``simulate`` runs each rank in a fresh child
    process)."""
    if dist.is_initialized():
        raise RuntimeError(
            "simulate: a process group exists in this process already; simulate in a process of its own "
            "(python -m lightning_parallel.simulate) or destroy it first."
        )
    dims = config.dims(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"--ranks: {rank} is not a rank of the world of {world_size}: give 0..{world_size - 1}.")
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        mesh = dims.build_mesh("cpu")
        yield SimulatedWorld(rank, dims, mesh, make_sharding(config, mesh, param_dtype=param_dtype_for(precision)))
    finally:
        dist.destroy_process_group()
