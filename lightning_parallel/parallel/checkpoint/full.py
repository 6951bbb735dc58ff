"""Full (unsharded) model and optimizer states in the format a single-process run uses. Pure torch.

A checkpoint in this format loads into any layout and into a plain LightningModule. Model states go
through torch's distributed-checkpoint ``state_dict`` helpers, which gather DTensor shards; optimizer
states are keyed by parameter index, as ``torch.optim.Optimizer.state_dict()`` keys them, instead of
the parameter names torch's helpers use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_parallel._compat import all_gather_single
from lightning_parallel.parallel.data.flat_group import SCALAR_STATE_KEYS
from lightning_parallel.parallel.data.sharding import StateView

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_GATHER_EVERYWHERE = StateDictOptions(full_state_dict=True)
_LOAD = StateDictOptions(full_state_dict=True)


def full_model_state_dict(module: nn.Module, every_rank: bool = False, trainable_only: bool = False) -> dict[str, Any]:
    """The whole model's state on rank 0, or on every rank; collective.

    On other ranks without ``every_rank`` the result is empty (torch gathers to rank 0 only). ``trainable_only``
    leaves frozen parameters out, ungathered (buffers stay).
    """
    options = _GATHER_EVERYWHERE if every_rank else _GATHER
    if trainable_only:
        options = dataclasses.replace(options, ignore_frozen_params=True)
    state = get_model_state_dict(module, options=options)
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


# ----- ZeRO-1/2 flat buffers in torch's own per-parameter format -----


def _to_full(p: nn.Parameter, local: Tensor) -> Tensor:
    """A per-element state of ``p`` made whole across tensor-parallel ranks (collective for DTensors)."""
    if isinstance(p, DTensor):
        local = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
    return local.detach().cpu().clone()


def _to_local(p: nn.Parameter, full: Tensor) -> Tensor:
    """This rank's tensor-parallel shard of a full per-element state of ``p``."""
    if isinstance(p, DTensor):
        return distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
    return full


def flat_full_state_dict(flat: StateView) -> dict:
    """A ZeRO-1/2 optimizer's state (the sharding's ``state_view``) as the unsharded optimizer would return it
    (collective: every rank calls)."""
    state: dict[int, dict] = {}
    param_groups = []
    index = 0
    for param_group, originals, fgs in zip(flat.optimizer.param_groups, flat.param_groups, flat.slices):
        ids = list(range(index, index + len(originals)))
        index += len(originals)
        param_groups.append({**{k: v for k, v in param_group.items() if k != "params"}, "params": ids})
        by_param = {id(p): i for p, i in zip(originals, ids)}
        for fg in fgs:
            if not flat.optimizer.state.get(fg.key):
                continue
            per_param: dict[int, dict] = {by_param[id(p)]: {} for p in fg.params}
            for key, value in flat.optimizer.state[fg.key].items():
                if key in SCALAR_STATE_KEYS or not torch.is_tensor(value):
                    for entry in per_param.values():
                        entry[key] = value.clone() if torch.is_tensor(value) else value
                    continue
                full = torch.empty_like(fg.buffer)
                all_gather_single(full, value.to(full.device), group=fg.group)
                for p, view in fg.views(full):
                    per_param[by_param[id(p)]][key] = _to_full(p, view)
            state.update(per_param)
    return {"state": state, "param_groups": param_groups}


def load_flat_full_state_dict(flat: StateView, state_dict: dict) -> None:
    """Give a ZeRO-1/2 optimizer this rank's slice of a state in torch's per-parameter format (any layout's)."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(flat.optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} param groups but configure_optimizers "
            f"returned one with {len(flat.optimizer.param_groups)}: resume with the same optimizer setup."
        )
    for param_group, saved, originals, fgs in zip(
        flat.optimizer.param_groups, saved_groups, flat.param_groups, flat.slices
    ):
        if len(saved["params"]) != len(originals):
            raise ValueError(
                f"A checkpoint param group holds {len(saved['params'])} parameters, the model's holds "
                f"{len(originals)}: the checkpoint is from a different model or optimizer setup."
            )
        param_group.update({k: v for k, v in saved.items() if k != "params"})
        saved_state = {id(p): state_dict["state"].get(i) for p, i in zip(originals, saved["params"])}
        for fg in fgs:
            entries = [saved_state[id(p)] for p in fg.params]
            if any(e is None for e in entries):
                continue
            shard_state = {}
            start, end = fg.start, fg.end
            for key, value in entries[0].items():
                if key in SCALAR_STATE_KEYS or not torch.is_tensor(value):
                    shard_state[key] = value.clone() if torch.is_tensor(value) else value
                    continue
                full = torch.zeros_like(fg.buffer)
                for (p, view), entry in zip(fg.views(full), entries):
                    view.copy_(_to_local(p, entry[key]).reshape(view.shape))
                shard_state[key] = full[start:end].clone().to(fg.key.device)
            flat.optimizer.state[fg.key] = shard_state
