"""Expert parallelism applied to a model: each MoE layer keeps E/ep of its experts. Pure torch.

The stacked expert weights become DTensors sharded on dim 0 over the ``expert`` mesh (the ``ep`` axis), so
checkpoints store them under their single-process names and shapes, clipping counts each expert once (the norm
is summed over ``ep``), and ZeRO shards them over the ranks that hold the same experts (the ``expert_shard``
role). Experts are replicated over tp: each tp rank routes the same tokens and exchanges them with the ep ranks
of its own tp index.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_parallel.parallel.devices import host_all_reduce
from lightning_parallel.parallel.expert.moe import GroupedExperts, moe_layers

EXPERT_AXIS = "ep"


def check_expert_degree(num_experts: int, ep: int, where: str = "") -> None:
    if num_experts % ep:
        raise ValueError(
            f"ep={ep} does not divide the {num_experts} experts{where}: choose ep among the divisors of {num_experts}."
        )


def check_expert_layout(root: nn.Module, ep: int) -> None:
    """Before launch: ``root`` has MoE layers and ep divides each one's experts (a ValueError naming the fix)."""
    layers = moe_layers(root)
    if not layers:
        raise ValueError(
            f"ep={ep} splits the experts of MoE layers, and {type(root).__name__} has none: use "
            "lightning_parallel.MoE for its FFNs (see docs/moe.md), or set ep=1."
        )
    for name, layer in layers.items():
        check_expert_degree(layer.num_experts, ep, f" of {name}")


def apply_expert_parallel(root: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Shard the experts of every MoE layer under ``root`` over the 1-D ``mesh``; returns the layers' paths (a
    pipeline stage may hold none: :func:`check_expert_layout` checks the whole model before launch).

    Raises:
        ValueError: when ep does not divide a layer's experts.
    """
    layers = moe_layers(root)
    ep = mesh.size()
    for name, layer in layers.items():
        check_expert_degree(layer.num_experts, ep, f" of {name}")
        _shard_experts(layer.experts, mesh)
        layer.ep_group = mesh.get_group()
    return list(layers)


def require_moe_layers(found: int, ep: int, model_name: str) -> None:
    """After the split, on every rank (collective over the world): some rank holds a MoE layer. Catches what
    :func:`check_expert_layout` could not see before launch (a model built partly in ``configure_model``)."""
    total = torch.tensor([found])
    if dist.is_available() and dist.is_initialized():
        total = host_all_reduce(total)  # a host count at setup: through the device an NCCL world serves
    if int(total.item()) == 0:
        raise ValueError(
            f"ep={ep} splits the experts of MoE layers, and {model_name} has none: use lightning_parallel.MoE "
            "for its FFNs (see docs/moe.md), or set ep=1."
        )


def _shard_experts(experts: GroupedExperts, mesh: DeviceMesh) -> None:
    index, ep = mesh.get_local_rank(), mesh.size()
    for name in ("w1", "w2", "w3"):
        param = getattr(experts, name)
        if param is None or isinstance(param, DTensor):
            continue
        rows = param.shape[0] // ep
        shard = param.detach()[index * rows : (index + 1) * rows].clone()
        dtensor = DTensor.from_local(shard, mesh, [Shard(0)], shape=param.shape, stride=param.stride(), run_check=False)
        setattr(experts, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def is_expert_param(p: torch.Tensor) -> bool:
    """True for a parameter split over the expert-parallel axis (its gradient meets over ``expert_shard``). A
    non-expert parameter ZeRO-3 shards over the flattened ``dp_ep`` mesh has no ``ep`` dimension of its own."""
    return isinstance(p, DTensor) and EXPERT_AXIS in (p.device_mesh.mesh_dim_names or ())
