"""What a checkpoint holds of a model trained only in part (adapters on a frozen base). Pure torch.

The module decides, in one place: a LightningModule with ``unsaved_state_keys()`` leaves those state-dict keys out
of every save (its ``on_save_checkpoint`` drops them: HFCausalLM with peft leaves out the frozen base) and may
refuse a checkpoint that does not fit what it left out with ``check_checkpoint(checkpoint)`` (another base). The
loads here ask it: the sharded load neither expects nor reads those keys, and checks first; the one-file load
leaves them as they are.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def unsaved_keys(module: nn.Module | None) -> set[str]:
    """The state-dict keys ``module`` leaves out of its checkpoints (none unless it says so)."""
    keys = getattr(module, "unsaved_state_keys", None)
    return set(keys()) if callable(keys) else set()


def check_checkpoint(module: nn.Module | None, checkpoint: dict[str, Any]) -> None:
    """Let ``module`` refuse ``checkpoint`` (everything but the tensors) before anything is loaded from it."""
    check = getattr(module, "check_checkpoint", None)
    if callable(check):
        check(checkpoint)
