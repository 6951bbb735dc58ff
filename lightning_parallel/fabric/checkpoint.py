"""``fabric.save`` / ``fabric.load`` under the mesh strategies: the Trainer strategies' sharded folders.

Fabric hands over a dict of the user's objects (``{"model": model, "optimizer": optimizer, "step": 5}``). It
becomes the checkpoint dict the Trainer's strategies write (``state_dict``, ``optimizer_states``, the rest in
``meta.pt``) and goes through :mod:`lightning_parallel.strategies.sharded_checkpoint` unchanged: every rank writes
what it holds under single-process names, so any layout, and the Trainer, resume it; a Trainer's folder loads here
too (its model into the one module of ``state``, its optimizers into the optimizers of ``state`` in order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.parallel.checkpoint import files as checkpoint_io
from lightning_parallel.strategies.sharded_checkpoint import LOADED_IN_PLACE

FABRIC_KEYS = "lightning_parallel_fabric_keys"  # which keys of the user's dict held the model and the optimizers
# what the Trainer needs in a folder it resumes, and what a load hands back to no one
TRAINER_KEYS = {"pytorch-lightning_version": lightning.__version__, "lr_schedulers": []}
INTERNAL = ("state_dict", "optimizer_states", LOADED_IN_PLACE, FABRIC_KEYS)


def _target(strategy: Any, model: nn.Module, optimizers: list[Optimizer]) -> Any:
    """``model`` and ``optimizers`` as the sharded folders' save and load take them (Fabric's saves block)."""
    return strategy.runtime.target(model, model, optimizers, strategy.global_rank, strategy.world_size)


def _split_state(strategy: Any, state: dict[str, Any]) -> tuple[str, list[str]]:
    """The key of the set-up model and the keys of the optimizers in ``state``."""
    models = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if len(models) != 1 or state[models[0]] is not strategy.module:
        raise ValueError(
            f"{type(strategy).__name__}: fabric.save and fabric.load take the model set up with fabric.setup under "
            f"one key of the state dict (found modules under {models}): {{'model': model, 'optimizer': optimizer}}."
        )
    return models[0], [k for k, v in state.items() if isinstance(v, Optimizer)]


def save(strategy: Any, path: Any, state: dict[str, Any], storage_options: Any, filter: Any) -> None:
    """Write ``state`` as a sharded folder at ``path`` (collective)."""
    if storage_options is not None or filter is not None:
        raise TypeError(
            f"{type(strategy).__name__} writes sharded folders with torch's distributed checkpoint: fabric.save takes "
            "no storage_options or filter."
        )
    model_key, optimizer_keys = _split_state(strategy, state)
    model = state[model_key]
    optimizers = [state[k] for k in optimizer_keys]
    rest = {
        k: v.state_dict() if isinstance(v, _Stateful) else v
        for k, v in state.items()
        if k != model_key and k not in optimizer_keys
    }
    checkpoint = {
        **TRAINER_KEYS,
        **rest,
        "state_dict": model.state_dict(),
        "optimizer_states": [{} for _ in optimizers],  # the states themselves are taken from the optimizers
        FABRIC_KEYS: {"model": model_key, "optimizers": optimizer_keys},
    }
    strategy.runtime.save(_target(strategy, model, optimizers), checkpoint, path)


def load_raw(strategy: Any, path: Any, module: nn.Module, strict: bool) -> dict[str, Any]:
    """``fabric.load_raw(path, model)``: a single-process state dict file (LitGPT's ``lit_model.pth``) into the set-up
    model, whatever its layout (its ``load_state_dict`` takes whole tensors: :mod:`.full_state`)."""
    if Path(path).is_dir():
        raise ValueError(
            f"{type(strategy).__name__}: fabric.load_raw reads a state dict file, and {str(path)!r} is a folder: load "
            "a sharded folder with fabric.load(path, {'model': model}), or consolidate it first."
        )
    module.load_state_dict(checkpoint_io.load_file(path), strict=strict)
    return {}


def load(strategy: Any, path: Any, state: Any, strict: bool) -> dict[str, Any]:
    """Fill the model and optimizers of ``state`` in place; the other entries of ``state`` get their saved values
    (a Stateful's ``load_state_dict``); returns what ``state`` did not ask for. A model alone: :func:`load_raw`."""
    if isinstance(state, nn.Module):
        return load_raw(strategy, path, state, strict)
    if not isinstance(state, dict) or not state:
        raise ValueError(
            f"{type(strategy).__name__}: fabric.load needs the objects to fill: "
            "fabric.load(path, {'model': model, 'optimizer': optimizer})."
        )
    if not checkpoint_io.is_sharded_checkpoint(path):
        raise ValueError(
            f"{type(strategy).__name__}: {str(path)!r} is not a sharded checkpoint folder (no .metadata and meta.pt "
            "in it): give a folder fabric.save or a Trainer with checkpoint_format='sharded' wrote."
        )
    model_key, optimizer_keys = _split_state(strategy, state)
    model = state[model_key]
    saved_keys = checkpoint_io.read_meta(Path(path)).get(FABRIC_KEYS, {})
    ordered = saved_keys.get("optimizers")
    if ordered is not None and set(ordered) == set(optimizer_keys):
        optimizer_keys = list(ordered)  # the optimizers in the order they were saved
    optimizers = [state[k] for k in optimizer_keys]
    remainder = strategy.runtime.load(_target(strategy, model, optimizers), path)
    for key in INTERNAL:
        remainder.pop(key, None)
    for key, obj in state.items():
        if key == model_key or key in optimizer_keys:
            continue
        if key not in remainder:
            if strict:
                raise KeyError(f"fabric.load: {str(path)!r} has no {key!r}; load with strict=False to leave it as is.")
            continue
        if isinstance(obj, _Stateful):
            obj.load_state_dict(remainder.pop(key))
        else:
            state[key] = remainder.pop(key)
    return remainder
