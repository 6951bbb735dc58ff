"""Full (unsharded) model and optimizer states in the format a single-process run uses. Pure torch.

A checkpoint in this format loads into any layout and into a plain LightningModule. Model states go
through torch's distributed-checkpoint ``state_dict`` helpers, which gather DTensor shards; optimizer
states are keyed by parameter index, as ``torch.optim.Optimizer.state_dict()`` keys them, instead of
the parameter names torch's helpers use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_GATHER_EVERYWHERE = StateDictOptions(full_state_dict=True)
_LOAD = StateDictOptions(full_state_dict=True)


def full_model_state_dict(module: nn.Module, every_rank: bool = False) -> dict[str, Any]:
    """The whole model's state on rank 0, or on every rank; collective.

    On other ranks without ``every_rank`` the result is empty (torch gathers to rank 0 only).
    """
    state = get_model_state_dict(module, options=_GATHER_EVERYWHERE if every_rank else _GATHER)
    # clone: parameters may be views into a flat ZeRO buffer that torch.save would write whole
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def load_full_model_state_dict(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load a full state into a (possibly sharded) module; every rank passes the full state."""
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, state, options=options)


def _param_names(module: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _index_to_name(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    names = _param_names(module)
    order = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in names]
    if missing:
        raise ValueError(
            "The optimizer holds parameters that are not in the model: build it from self.parameters() in "
            "configure_optimizers."
        )
    return {i: names[id(p)] for i, p in enumerate(order)}


def full_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state keyed by parameter index (rank 0 holds it); collective."""
    by_name = get_optimizer_state_dict(module, optimizer, options=_GATHER)
    if not by_name.get("param_groups"):
        return {}
    name_to_index = {name: i for i, name in _index_to_name(module, optimizer).items()}
    state = {name_to_index[name]: s for name, s in by_name["state"].items()}
    groups = [{**g, "params": [name_to_index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Load an index-keyed full optimizer state into an optimizer over (possibly sharded) parameters."""
    index_to_name = _index_to_name(module, optimizer)
    saved = [i for g in state_dict["param_groups"] for i in g["params"]]
    if len(saved) != len(index_to_name):
        raise ValueError(
            f"The checkpoint's optimizer holds {len(saved)} parameters, this one {len(index_to_name)}: the "
            "checkpoint is from a different model or optimizer setup."
        )
    by_name = {
        "state": {index_to_name[i]: s for i, s in state_dict["state"].items()},
        "param_groups": [{**g, "params": [index_to_name[i] for i in g["params"]]} for g in state_dict["param_groups"]],
    }
    set_optimizer_state_dict(module, optimizer, by_name, options=_LOAD)
