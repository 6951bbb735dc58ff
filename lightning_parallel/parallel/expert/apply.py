"""Expert parallelism applied to a model: each MoE layer keeps E/ep of its experts. Pure torch.

Two kinds of layers split: this package's :class:`~.moe.MoE`, found by type, and the modules a model names in its
``expert_parallel_plan()`` (module path, ``*`` for one name -> :class:`ExpertStyle`: Hugging Face's experts, see
:mod:`lightning_parallel.hf.experts`). The stacked expert weights become DTensors sharded on dim 0 over the ``expert``
mesh (the ``ep`` axis), so
checkpoints store them under their single-process names and shapes, clipping counts each expert once (the norm
is summed over ``ep``), and ZeRO shards them over the ranks that hold the same experts (the ``expert_shard``
role). Experts are replicated over tp: each tp rank routes the same tokens and exchanges them with the ep ranks
of its own tp index.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_parallel.parallel.devices import host_all_reduce
from lightning_parallel.parallel.expert.moe import moe_layers
from lightning_parallel.parallel.tensor.plan import path_matches

EXPERT_AXIS = "ep"


def check_expert_degree(num_experts: int, ep: int, where: str = "") -> None:
    if num_experts % ep:
        raise ValueError(
            f"ep={ep} does not divide the {num_experts} experts{where}: choose ep among the divisors of {num_experts}."
        )


class ExpertStyle:
    """How the experts of one module a model's ``expert_parallel_plan()`` names split over ep (the model's own
    experts kept, under their own names): subclasses say how many experts the module holds and split them."""

    def num_experts(self, module: nn.Module) -> int:
        raise NotImplementedError

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """Keep this rank's E/ep experts of ``module`` (dim 0 of its stacked weights, :func:`shard_expert_params`)
        and route its tokens to the ranks of the 1-D ``mesh`` holding theirs."""
        raise NotImplementedError


def planned_layers(root: nn.Module, plan: Mapping[str, ExpertStyle] | None) -> dict[str, tuple[nn.Module, ExpertStyle]]:
    """The modules of ``root`` the plan's patterns name (a pipeline stage holds some of them), by path."""
    found = {}
    for path, module in root.named_modules():
        style = next((s for pattern, s in (plan or {}).items() if path_matches(path, pattern)), None)
        if style is not None:
            found[path] = (module, style)
    return found


def check_expert_layout(root: nn.Module, ep: int, plan: Mapping[str, ExpertStyle] | None = None) -> None:
    """Before launch: ``root`` has MoE layers (or modules its expert plan names) and ep divides each one's experts
    (a ValueError naming the fix)."""
    counts = {name: layer.num_experts for name, layer in moe_layers(root).items()}
    counts.update({name: style.num_experts(m) for name, (m, style) in planned_layers(root, plan).items()})
    if not counts:
        raise ValueError(_NO_EXPERTS.format(ep=ep, model=type(root).__name__))
    for name, experts in counts.items():
        check_expert_degree(experts, ep, f" of {name}")


def apply_expert_parallel(
    root: nn.Module, mesh: DeviceMesh, plan: Mapping[str, ExpertStyle] | None = None
) -> list[str]:
    """Shard the experts of every MoE layer under ``root``, and of every module ``plan`` names, over the 1-D
    ``mesh``; returns their paths (a pipeline stage may hold none: :func:`check_expert_layout` checks the whole
    model before launch).

    Raises:
        ValueError: when ep does not divide a layer's experts.
    """
    layers = moe_layers(root)
    ep = mesh.size()
    for name, layer in layers.items():
        check_expert_degree(layer.num_experts, ep, f" of {name}")
        shard_expert_params(layer.experts, ("w1", "w2", "w3"), mesh)
        layer.ep_group = mesh.get_group()
    planned = planned_layers(root, plan)
    for name, (module, style) in planned.items():
        check_expert_degree(style.num_experts(module), ep, f" of {name}")
        style.apply(module, mesh)
    return list(layers) + list(planned)


def require_moe_layers(found: int, ep: int, model_name: str) -> None:
    """After the split, on every rank (collective over the world): some rank holds a MoE layer. Catches what
    :func:`check_expert_layout` could not see before launch (a model built partly in ``configure_model``)."""
    total = torch.tensor([found])
    if dist.is_available() and dist.is_initialized():
        total = host_all_reduce(total)  # a host count at setup: through the device an NCCL world serves
    if int(total.item()) == 0:
        raise ValueError(_NO_EXPERTS.format(ep=ep, model=model_name))


_NO_EXPERTS = (
    "ep={ep} splits the experts of MoE layers, and {model} has none: use lightning_parallel.MoE for its FFNs (see "
    "the README's MoE section), give the model an expert_parallel_plan(), or set ep=1."
)


def shard_expert_params(module: nn.Module, names: tuple[str, ...], mesh: DeviceMesh) -> None:
    """``module``'s parameters ``names`` (stacked on dim 0 by expert; absent or None ones skipped) become DTensors
    sharded on dim 0 over the 1-D ``mesh``: this rank keeps its experts' rows, the global shape stays."""
    index, ep = mesh.get_local_rank(), mesh.size()
    for name in names:
        param = getattr(module, name, None)
        if param is None or isinstance(param, DTensor):
            continue
        rows = param.shape[0] // ep
        shard = param.detach()[index * rows : (index + 1) * rows].clone()
        dtensor = DTensor.from_local(shard, mesh, [Shard(0)], shape=param.shape, stride=param.stride(), run_check=False)
        setattr(module, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def is_expert_param(p: torch.Tensor) -> bool:
    """True for a parameter split over the expert-parallel axis (its gradient meets over ``expert_shard``). A
    non-expert parameter ZeRO-3 shards over the flattened ``dp_ep`` mesh has no ``ep`` dimension of its own."""
    return isinstance(p, DTensor) and EXPERT_AXIS in (p.device_mesh.mesh_dim_names or ())
