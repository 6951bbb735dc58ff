"""Small helpers for code that handles plain tensors and DTensors alike. Pure torch.

May import: torch only (every parallelism imports it).
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor


def local(t: Tensor) -> Tensor:
    """This rank's data: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def placed_like(param: Tensor, grad: Tensor) -> Tensor:
    """A DTensor gradient in its parameter's placements (a Partial one is reduced here); others unchanged."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(placements=param.placements)
    return grad


def like(param: Tensor, local_value: Tensor) -> Tensor:
    """``local_value`` as a tensor shaped and placed like ``param``: a DTensor for a DTensor parameter (no copy)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local_value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
        )
    return local_value


def split_axes(t: Tensor) -> tuple[str, ...]:
    """Names of the mesh axes a DTensor is split over (not replicated); () for a plain tensor.

    Not ``is_shard()``: FSDP2 over a tensor-parallel dim uses ``_StridedShard``, whose ``is_shard()`` is False.
    A flattened dimension (``"dp_ep"``) names the axes it joins.
    """
    if not isinstance(t, DTensor):
        return ()
    names = t.device_mesh.mesh_dim_names
    assert names is not None, "meshes here have named axes"
    return tuple(
        axis for i, placement in enumerate(t.placements) if not placement.is_replicate() for axis in names[i].split("_")
    )
