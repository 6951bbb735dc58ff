"""Sharded checkpoint folders for the mesh strategies: what Lightning's save and load calls become.

Lightning builds a checkpoint dict (``state_dict``, ``optimizer_states``, loops, schedulers, callbacks)
and hands it to the strategy. Here the model and optimizer states stay sharded as each rank holds them
and go to torch's distributed checkpoint under layout-independent names (see
:mod:`lightning_parallel.parallel.sharded_state`); the rest goes to ``meta.pt``. Loading fills the live
model and optimizer of whatever layout runs now, so any layout resumes any other.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_parallel.parallel import checkpoint_io
from lightning_parallel.parallel.sharded_state import (
    MODEL,
    install_optimizer_state,
    model_state,
    optimizer_load_targets,
    optimizer_state,
)
from lightning_parallel.parallel.zero import FlatZero

FORMATS = ("sharded", "full")
LOADED_IN_PLACE = "lightning_parallel_loaded_in_place"  # marks a checkpoint whose states are already loaded


def check_checkpoint_format(value: str) -> None:
    if value not in FORMATS:
        raise ValueError(
            f"checkpoint_format={value!r} is unknown: use 'sharded' (a folder per checkpoint, written by every "
            "rank, any layout resumes it) or 'full' (one file gathered on rank 0, for plain Lightning)."
        )


def hyperparameters(optimizer: Optimizer) -> dict[str, Any]:
    """What meta.pt keeps of an optimizer: its param groups' settings (the states go to the shards)."""
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def save(
    strategy: Any, checkpoint: dict[str, Any], filepath: str | Path, flat_zero: list[FlatZero | None], order: list[str]
) -> None:
    """Write ``checkpoint`` as a sharded folder at ``filepath`` (collective; atomic)."""
    path = Path(strategy.broadcast(str(filepath)))
    token = strategy.broadcast(uuid.uuid4().hex[:12])
    model = strategy.model
    tensors: dict[str, Any] = {MODEL + k: v for k, v in checkpoint.pop("state_dict").items()}
    # save_checkpoint(weights_only=True) leaves the optimizers out of the dict: leave them out of the folder
    optimizers = strategy.optimizers if checkpoint.pop("optimizer_states", None) is not None else []
    for i, optimizer in enumerate(optimizers):
        tensors.update(optimizer_state(model, optimizer, i, order, flat_zero[i]))
    meta = None
    if strategy.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {**checkpoint}
        if optimizers:
            meta["optimizer_states"] = [hyperparameters(o) for o in optimizers]
    strategy.barrier("sharded_checkpoint_prepare")
    checkpoint_io.save_sharded(path, tensors, meta, token, strategy.is_global_zero)
    strategy.barrier("sharded_checkpoint_written")
    if strategy.is_global_zero:
        checkpoint_io.publish(path, token)
    strategy.barrier("sharded_checkpoint_published")


def load(strategy: Any, path: str | Path, flat_zero: list[FlatZero | None]) -> dict[str, Any]:
    """Fill the live model (and optimizers, when fitting) from a sharded folder; returns the rest of the
    checkpoint for Lightning's loops, schedulers and callbacks."""
    path = Path(strategy.broadcast(str(path)))
    meta = checkpoint_io.read_meta(path)
    saved = checkpoint_io.saved_tensors(path)
    model: nn.Module = strategy.model
    targets: dict[str, Any] = model_state(model)
    missing = sorted(k[len(MODEL) :] for k in targets if k not in saved)
    if missing:
        raise KeyError(
            f"{path} has no {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: it was saved from a "
            "different model. Resume with the model that wrote it."
        )
    installs = []
    # a weights-only folder has no optimizers: Lightning itself says so if fit() needs them
    optimizers = strategy.optimizers if "optimizer_states" in meta else []
    saved_optimizers = meta.get("optimizer_states", [])
    if optimizers and len(saved_optimizers) != len(optimizers):  # validate/test/predict have none
        raise ValueError(
            f"{path} holds {len(saved_optimizers)} optimizers but configure_optimizers returned "
            f"{len(optimizers)}: resume with the same optimizer setup."
        )
    for i, optimizer in enumerate(optimizers):
        _check_param_groups(path, i, saved_optimizers[i]["param_groups"], optimizer)
        opt_targets, states = optimizer_load_targets(model, optimizer, i, saved, flat_zero[i])
        targets.update(opt_targets)
        installs.append((optimizer, states, saved_optimizers[i]["param_groups"]))
    checkpoint_io.load_sharded(path, targets)
    for flat in flat_zero:
        if flat is not None and flat.offload:  # the host copy of this rank's slice is what the optimizer steps
            for fg in flat.flat_groups:
                start, end = fg.local_range(flat.rank)
                fg.shard.data.copy_(fg.flat_param[start:end])
    for optimizer, states, groups in installs:
        install_optimizer_state(optimizer, states)
        for group, saved_group in zip(optimizer.param_groups, groups):
            group.update(saved_group)
    return {**meta, "state_dict": {}, LOADED_IN_PLACE: True}


def _check_param_groups(path: Path, index: int, saved: list[dict[str, Any]], optimizer: Optimizer) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"{path}: optimizer {index} had {len(saved)} param groups, configure_optimizers now returns "
            f"{len(optimizer.param_groups)}: resume with the same optimizer setup."
        )
