"""What the Trainer's checkpoint hooks do under the mesh strategies: sharded folders (default) or one gathered file.

``checkpoint_format="sharded"``: every rank writes what it holds under single-process names
(:mod:`.sharded_checkpoint`), and any layout loads it in place. ``"full"``: one file on rank 0 in the
single-process format (each pipeline stage contributes its layers and their optimizer states), which plain
Lightning reads. Both formats load under any layout.

Functions over the :class:`~lightning_parallel.strategies.runtime.MeshRuntime` (the sharding, the split) and what
the caller names (the model, the LightningModule, the torch optimizers, the format): :class:`MeshStrategy`'s hooks
are one call each into them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.parallel.checkpoint import files as checkpoint_io
from lightning_parallel.parallel.checkpoint import storage
from lightning_parallel.parallel.checkpoint.async_save import STAGING_MISSING, AsyncCheckpointer
from lightning_parallel.parallel.checkpoint.full import (
    flat_full_state_dict,
    full_model_state_dict,
    full_optimizer_state_dict,
    load_flat_full_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from lightning_parallel.parallel.checkpoint.pipeline import (
    gather_pipeline_optimizer_state,
    pipeline_local_optimizer_state,
)
from lightning_parallel.parallel.checkpoint.selection import unsaved_keys
from lightning_parallel.strategies.runtime import MeshRuntime
from lightning_parallel.strategies.sharded_checkpoint import LOADED_IN_PLACE, CheckpointTarget, finish_async

FORMATS = ("sharded", "full")


def check_checkpoint_format(value: str) -> None:
    if value not in FORMATS:
        raise ValueError(
            f"checkpoint_format={value!r} is unknown: use 'sharded' (a folder per checkpoint, written by every "
            "rank, any layout resumes it) or 'full' (one file gathered on rank 0, for plain Lightning)."
        )


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (or the optimizer itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def check_async_save(value: Any, checkpoint_format: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"async_save={value!r} must be True or False.")
    if value and checkpoint_format != "sharded":
        raise ValueError(
            f"async_save=True writes sharded folders with torch's async_save: it cannot write checkpoint_format="
            f"{checkpoint_format!r}. Use checkpoint_format='sharded' (the default) or async_save=False."
        )
    if value and STAGING_MISSING:
        raise ValueError(f"async_save=True: {STAGING_MISSING}. Use async_save=False (saves then block).")


def saves_async(async_save: bool, trainer: Any) -> bool:
    """Whether a save goes on in a thread: ``async_save`` while fit runs (a save outside fit, which nothing would
    wait for, is written before it returns)."""
    running = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
    return async_save and running and trainer.state.fn == TrainerFn.FITTING


def close_async(checkpointer: AsyncCheckpointer | None, world_size: int, trainer: Any) -> None:
    """Teardown (also after a preemption's save): the save in flight finishes, its thread and buffers go. After a
    failed run its save's own failure is only warned about: the run's error is the one to see."""
    if checkpointer is None:
        return
    failed = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
    try:
        finish_async(checkpointer, world_size, alike=False)
    except (OSError, RuntimeError) as error:
        if not failed:
            raise
        rank_zero_warn(str(error))
    finally:
        checkpointer.close()


class AsyncSaves:
    """``async_save=True``: the Trainer door's asynchronous saver (one save at a time), made at the first save during
    fit; waited for before a load (:meth:`finish`), closed at teardown (:meth:`close`)."""

    def __init__(self) -> None:
        self.checkpointer: AsyncCheckpointer | None = None

    def saver(self, async_save: bool, trainer: Any, rank: int, world: int, timeout: Any) -> AsyncCheckpointer | None:
        """The saver while ``async_save`` and fitting (:func:`saves_async`); None: the save is written at once."""
        if not saves_async(async_save, trainer):
            return None
        if self.checkpointer is None:
            self.checkpointer = AsyncCheckpointer(rank, world, timeout)
        return self.checkpointer

    def finish(self, world_size: int) -> None:
        """Wait for the save in flight (collective); every rank raises alike if it failed."""
        finish_async(self.checkpointer, world_size)

    def close(self, world_size: int, trainer: Any) -> None:
        checkpointer, self.checkpointer = self.checkpointer, None
        close_async(checkpointer, world_size, trainer)


def remove_later(checkpointer: AsyncCheckpointer | None, path: Any, is_global_zero: bool) -> bool:
    """A folder the save in flight may still link to is removed once that save is complete (True); else False:
    the caller removes it now."""
    if checkpointer is None or not checkpointer.in_flight:
        return False
    if is_global_zero:
        checkpointer.remove_later(storage.local(str(path)))
    return True


def settle_params(runtime: MeshRuntime) -> None:
    """overlap_grad_reduce: ZeRO-1/2's parameter gathers still in flight land before the buffers are read or
    written (before the runtime has its sharding there is nothing to wait for)."""
    if runtime.sharding is not None:
        runtime.sharding.settle_params()


def full_state_dict(runtime: MeshRuntime, model: nn.Module, trainable_only: bool = False) -> dict[str, Any]:
    """The whole model's state in the single-process format, on rank 0 (collective; every stage's layers);
    ``trainable_only``: without the frozen parameters (never gathered)."""
    settle_params(runtime)
    if runtime.stages is None:
        return full_model_state_dict(model, trainable_only=trainable_only)
    state = full_model_state_dict(model, every_rank=True, trainable_only=trainable_only)
    group = runtime.require_mesh().group("stage")
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, state, group=group)
    merged: dict[str, Any] = {}
    for part in everyone:
        for key, value in part.items():
            merged.setdefault(key, value)
    return merged


def module_state_dict(runtime: MeshRuntime, model: nn.Module, module: Any, checkpoint_format: str) -> dict[str, Any]:
    """The model's entry of a checkpoint: the shards as they are (sharded: the save writes them in place), else the
    gathered state (a module that leaves its frozen parameters out of checkpoints: not gathered either)."""
    settle_params(runtime)
    if checkpoint_format == "sharded":
        return model.state_dict()
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return full_state_dict(runtime, model, trainable_only=bool(frozen) and frozen <= unsaved_keys(module))


def optimizer_state(runtime: MeshRuntime, model: nn.Module, optimizer: Any, checkpoint_format: str) -> dict[str, Any]:
    """An optimizer's entry of a checkpoint: empty when sharded (the save reads the optimizer itself), else the
    single-process state (under pp every stage's, on rank 0)."""
    if checkpoint_format == "sharded":
        return {}
    raw = unwrap_optimizer(optimizer)
    flat = runtime.require_sharding().state_view(raw)
    local = flat_full_state_dict(flat) if flat is not None else full_optimizer_state_dict(model, raw)
    if runtime.stages is None:
        return local
    group = runtime.require_mesh().group("stage")
    return gather_pipeline_optimizer_state(local, local_param_names(runtime, model, raw), runtime.stages, group)


def load_checkpoint(runtime: MeshRuntime, target: Callable[[], CheckpointTarget], path: Any) -> dict[str, Any]:
    """A sharded folder into ``target()`` in place (the rest of it returned), or a checkpoint file's dict. The
    target is asked for only for a sharded folder: a bad path is refused before anything needs a model."""
    settle_params(runtime)  # loading writes the buffers in place
    if checkpoint_io.is_sharded_checkpoint(path):
        return runtime.load(target(), path)
    if storage.isdir(str(path)):
        raise FileNotFoundError(
            f"ckpt_path={str(path)!r} is a folder but not a sharded checkpoint (no .metadata and "
            "meta.pt in it): give the folder a save wrote, or a checkpoint file."
        )
    return checkpoint_io.load_file(path)


def load_model_state(
    runtime: MeshRuntime, model: nn.Module, module: Any, checkpoint: Mapping[str, Any], strict: bool
) -> None:
    """A one-file checkpoint's model state into the split ``model`` (this rank's stages under pp); the keys
    ``module`` leaves out of its saves (a frozen base) kept as they are. Nothing when loaded in place already."""
    if checkpoint.get(LOADED_IN_PLACE):
        return
    skip = unsaved_keys(module)
    state = {k: v for k, v in checkpoint["state_dict"].items() if k not in skip}
    if runtime.stages is not None:
        mine = set(model.state_dict())
        state = {k: v for k, v in state.items() if k in mine}
    if skip and strict:
        missing = sorted(set(model.state_dict()) - skip - set(state))
        if missing:
            raise ValueError(
                f"the checkpoint lacks the trained tensors {missing[:4]}: resume with the model that saved it."
            )
    load_full_model_state_dict(model, state, strict=strict and not skip)


def load_optimizer_states(
    runtime: MeshRuntime, model: nn.Module, optimizers: list[Any], checkpoint: Mapping[str, Any]
) -> None:
    """A one-file checkpoint's optimizer states into ``optimizers`` (under pp this rank's parameters' only)."""
    if checkpoint.get(LOADED_IN_PLACE):
        return
    raws = [unwrap_optimizer(o) for o in optimizers]
    states = list(checkpoint["optimizer_states"])
    if runtime.stages is not None:
        group = runtime.require_mesh().group("stage")
        states = [
            pipeline_local_optimizer_state(full, local_param_names(runtime, model, o), runtime.stages, group)
            for o, full in zip(raws, states)
        ]
    for optimizer, state in zip(raws, states):
        flat = runtime.require_sharding().state_view(optimizer)
        if flat is not None:
            load_flat_full_state_dict(flat, state)
        else:
            load_full_optimizer_state_dict(model, optimizer, state)


def local_param_names(runtime: MeshRuntime, model: nn.Module, optimizer: Optimizer) -> list[list[str]]:
    """The parameter names of each of ``optimizer``'s groups, as configure_optimizers built them."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return [[names[id(p)] for p in group] for group in runtime.require_sharding().param_groups(optimizer)]
