"""``model.load_state_dict(whole)`` on a model a Fabric mesh strategy split: a single-process state dict loads.

Once split, a parameter is a DTensor (tp, ZeRO-3) or lives on another pipeline stage; torch's ``load_state_dict``
would refuse a whole tensor for a DTensor ("got mixed torch.Tensor and DTensor"). A pre-hook on the set-up model
turns each whole value into the DTensor its parameter is (``distribute_tensor`` with the parameter's mesh and
placements: every rank passes the same whole state, as in one process) and, under pp, leaves out the keys of layers
another stage holds. What code written for one process does (LitGPT's scripts load ``lit_model.pth`` this way) then
works under any layout. Pure torch.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor


def _whole(value: Any) -> Any:
    """A lazily loaded tensor (``lightning``'s ``_lazy_load``, LitGPT's ``lazy_load``) read in."""
    return value._load_tensor() if callable(getattr(value, "_load_tensor", None)) else value


def accept_whole_state(module: nn.Module, elsewhere: set[str]) -> None:
    """Let ``module`` (split in place) load a single-process state dict; ``elsewhere``: the keys of the unsplit
    model that other pipeline stages hold (dropped from what is loaded here).

    Each value becomes a DTensor in the pre-hook of the module that holds the parameter, when torch's loading
    reaches it: after any renaming a parent's ``_load_from_state_dict`` does first (LitGPT's LoRA ``GPT`` maps a
    base checkpoint's ``attn.qkv.weight`` onto its ``attn.qkv.linear.weight`` there)."""
    mine = set(module.state_dict(keep_vars=True))

    def hook(_: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix:
            return  # the whole model's call only (a submodule's own load_state_dict is left alone)
        for key in [k for k in state if k in elsewhere and k not in mine]:
            del state[key]
        for key, value in list(state.items()):
            state[key] = _whole(value)

    module.register_load_state_dict_pre_hook(hook)
    for sub in module.modules():
        held = {n: t for n, t in (*sub._parameters.items(), *sub._buffers.items()) if isinstance(t, DTensor)}
        if held:
            sub.register_load_state_dict_pre_hook(partial(_to_dtensors, held))


def _to_dtensors(held: dict[str, DTensor], _: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """A module's pre-hook: the whole values of its own DTensor parameters and buffers (``held``, by local name)
    distributed as they are (every rank passes the same whole state, as in one process)."""
    for name, target in held.items():
        value = _whole(state.get(prefix + name))
        if isinstance(value, Tensor) and not isinstance(value, DTensor):
            whole = value.to(device=target.device, dtype=target.dtype)
            state[prefix + name] = distribute_tensor(whole, target.device_mesh, target.placements)
