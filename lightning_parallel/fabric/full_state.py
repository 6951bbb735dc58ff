"""``model.load_state_dict(whole)`` on a model a Fabric mesh strategy split: a single-process state dict loads.

Once split, a parameter is a DTensor (tp, ZeRO-3) or lives on another pipeline stage; torch's ``load_state_dict``
would refuse a whole tensor for a DTensor ("got mixed torch.Tensor and DTensor"). A pre-hook on the set-up model
turns each whole value into the DTensor its parameter is (``distribute_tensor`` with the parameter's mesh and
placements: every rank passes the same whole state, as in one process) and, under pp, leaves out the keys of layers
another stage holds. What code written for one process does (LitGPT's scripts load ``lit_model.pth`` this way) then
works under any layout. Pure torch.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor


def _whole(value: Any) -> Any:
    """A lazily loaded tensor (``lightning``'s ``_lazy_load``, LitGPT's ``lazy_load``) read in."""
    return value._load_tensor() if callable(getattr(value, "_load_tensor", None)) else value


def accept_whole_state(module: nn.Module, elsewhere: set[str]) -> None:
    """Let ``module`` (split in place) load a single-process state dict; ``elsewhere``: the keys of the unsplit
    model that other pipeline stages hold (dropped from what is loaded here)."""
    mine = dict(module.state_dict(keep_vars=True))

    def hook(_: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix:
            return  # the whole model's call only (a submodule's own load_state_dict is left alone)
        for key in [k for k in state if k in elsewhere and k not in mine]:
            del state[key]
        for key, value in list(state.items()):
            target = mine.get(key)
            value = _whole(value)
            if isinstance(target, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor):
                whole = value.to(device=target.device, dtype=target.dtype)
                state[key] = distribute_tensor(whole, target.device_mesh, target.placements)
            else:
                state[key] = value

    module.register_load_state_dict_pre_hook(hook)
