"""What one optimizer step does to the gradients of a parallelized model, under either front door (the Trainer's
:class:`~lightning_parallel.strategies.base.MeshStrategy` and Fabric's
:class:`~lightning_parallel.fabric.strategy.MeshFabricStrategy`). Pure torch.

After the step's last backward: gradients of weights tied across pipeline stages summed over ``stage``, then the
data-parallel reduction of the sharding, then the hooks :func:`~lightning_parallel.parallel.parallelize.parallelize`
left (``Parallelized.grad_hooks``); clipping by the norm of the whole model, however it is split.
"""

from __future__ import annotations

from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.parallel.clip import clip_grad_norm_
from lightning_parallel.parallel.data.sharding import DataParallelSharding
from lightning_parallel.parallel.mesh import ParallelMesh, axis_combinations
from lightning_parallel.parallel.parallelize import Parallelized


def reduce_step_gradients(parallel: Parallelized | None, sharding: DataParallelSharding, optimizer: Optimizer) -> None:
    """Once per optimizer step, after its last backward, before clipping and the update."""
    tied = parallel.tied if parallel is not None else None
    if tied is not None:
        tied.reduce()  # before the data-parallel reduction: both are sums
    sharding.reduce_gradients(optimizer)
    if parallel is not None and parallel.grad_hooks:  # axes that act on the reduced gradients (Parallelized)
        grads = [g for g, _, _ in sharding.grad_pieces(optimizer)]
        for hook in parallel.grad_hooks:
            hook(grads)


def clip_model_grad_norm(
    optimizer: Optimizer,
    max_norm: float,
    norm_type: float,
    parallel: Parallelized | None,
    sharding: DataParallelSharding,
    mesh: ParallelMesh,
) -> Tensor:
    """Clip ``optimizer``'s gradients by the norm of the whole model's gradient; returns that norm.

    Args:
        optimizer: the torch optimizer (ZeRO-1/2: re-pointed at this rank's flat slices).
        max_norm, norm_type: as torch's ``clip_grad_norm_``.
        parallel: what :func:`~lightning_parallel.parallel.parallelize.parallelize` did (tied weights under pp).
        sharding: the data-parallel sharding (it hands over this rank's gradient pieces and the axes splitting them).
        mesh: the world's mesh.
    """
    tied = parallel.tied if parallel is not None else None
    skip = tied.excluded_from_norm() if tied is not None else set()  # copies another rank counts
    # ranks of different pipeline stages hold different parameters altogether: their norms add up too
    stage_axes = tuple(mesh["stage"].mesh_dim_names or ()) if mesh.dims.pp > 1 else ()
    pieces = sharding.grad_pieces(optimizer)
    counted = [(g, (*axes, *stage_axes)) for g, p, axes in pieces if id(p) not in skip]
    uncounted = [g for g, p, _ in pieces if id(p) in skip]
    return clip_grad_norm_(counted, max_norm, mesh.axis_groups(), norm_type, axis_combinations(), uncounted)
