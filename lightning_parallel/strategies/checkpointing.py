"""Lightning's checkpoint hooks for the mesh strategies: sharded folders (default) or one gathered file.

``checkpoint_format="sharded"``: every rank writes what it holds under single-process names
(:mod:`.sharded_checkpoint`), and any layout loads it in place. ``"full"``: one file on rank 0 in the
single-process format (each pipeline stage contributes its layers and their optimizer states), which plain
Lightning reads. Both formats load under any layout.
"""

from __future__ import annotations

from collections.abc import Mapping
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
from lightning_parallel.parallel.data.sharding import StateView
from lightning_parallel.strategies import sharded_checkpoint
from lightning_parallel.strategies.runtime import MeshRuntime
from lightning_parallel.strategies.sharded_checkpoint import LOADED_IN_PLACE

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


class ShardedCheckpointing:
    """Lightning's checkpoint hooks of :class:`~lightning_parallel.strategies.base.MeshStrategy`, over its
    ``runtime`` (:class:`~lightning_parallel.strategies.runtime.MeshRuntime`: the sharding, the split, the sharded
    folders' save and load) and Lightning's ``model``, ``optimizers`` and ``checkpoint_format``; the asynchronous
    saver is its own."""

    model: nn.Module | None
    runtime: MeshRuntime
    checkpoint_format: str
    async_save: bool = False
    _async_checkpointer: AsyncCheckpointer | None = None

    def async_checkpointer(self, create: bool = True) -> AsyncCheckpointer | None:
        """The asynchronous saver while ``async_save`` and fitting (a save outside fit, which nothing would wait
        for, is written before it returns); None otherwise. ``create=False``: the one there is, if any."""
        if not create:
            return self._async_checkpointer
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        running = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        if not (self.async_save and running and trainer.state.fn == TrainerFn.FITTING):
            return None
        if self._async_checkpointer is None:
            rank, world = self.global_rank, self.world_size  # type: ignore[attr-defined]
            self._async_checkpointer = AsyncCheckpointer(rank, world, self.runtime.timeout)  # type: ignore[attr-defined]
        return self._async_checkpointer

    def finish_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight (collective); every rank raises alike if it failed."""
        sharded_checkpoint.finish_async(self)

    def _close_checkpointer(self) -> None:
        """Teardown (also after a preemption's save): the save in flight finishes, its thread and buffers go.
        After a failed run its save's own failure is only warned about: the run's error is the one to see."""
        checkpointer = self._async_checkpointer
        if checkpointer is None:
            return
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        failed = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        try:
            sharded_checkpoint.finish_async(self, alike=False)
        except (OSError, RuntimeError) as error:
            if not failed:
                raise
            rank_zero_warn(str(error))
        finally:
            self._async_checkpointer = None
            checkpointer.close()

    def _split(self) -> Any:
        return self.runtime.stages

    def _flat_of(self, optimizer: Any) -> StateView | None:
        return self.sharding.state_view(unwrap_optimizer(optimizer))  # type: ignore[attr-defined]

    def _unwrapped_optimizers(self) -> list[Optimizer]:
        return [unwrap_optimizer(o) for o in self.optimizers]  # type: ignore[attr-defined]

    def _settle_params(self) -> None:
        """overlap_grad_reduce: ZeRO-1/2's parameter gathers still in flight land before the buffers are read or
        written (before the strategy set up its sharding there is nothing to wait for)."""
        sharding = self.runtime.sharding
        if sharding is not None:
            sharding.settle_params()

    def _pp_group(self) -> dist.ProcessGroup:
        return self.mesh.group("stage")  # type: ignore[attr-defined]

    # ----- saving -----

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, Any]:
        """The whole model's state in the single-process format, on rank 0 (collective; every stage's layers);
        ``trainable_only``: without the frozen parameters (never gathered)."""
        assert self.model is not None
        self._settle_params()
        if self._split() is None:
            return full_model_state_dict(self.model, trainable_only=trainable_only)
        state = full_model_state_dict(self.model, every_rank=True, trainable_only=trainable_only)
        everyone: list[Any] = [None] * dist.get_world_size(self._pp_group())
        dist.all_gather_object(everyone, state, group=self._pp_group())
        merged: dict[str, Any] = {}
        for part in everyone:
            for key, value in part.items():
                merged.setdefault(key, value)
        return merged

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        self._settle_params()
        if self.checkpoint_format == "sharded":
            return self.model.state_dict()  # the shards as they are: save_checkpoint writes them in place
        # a module that leaves its frozen parameters out of checkpoints (a base under adapters): not gathered either
        frozen = {name for name, p in self.model.named_parameters() if not p.requires_grad}
        return self.full_state_dict(trainable_only=bool(frozen) and frozen <= unsaved_keys(self.lightning_module))

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.checkpoint_format == "sharded":
            return {}  # save_checkpoint takes each rank's states from the optimizers themselves
        assert self.model is not None
        flat = self._flat_of(optimizer)
        local = (
            flat_full_state_dict(flat)
            if flat is not None
            else full_optimizer_state_dict(self.model, unwrap_optimizer(optimizer))
        )
        if self._split() is None:
            return local
        return gather_pipeline_optimizer_state(
            local, self._local_param_names(optimizer), self._split(), self._pp_group()
        )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self._settle_params()
        if self.checkpoint_format == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        if storage_options is not None:
            raise TypeError(
                "checkpoint_format='sharded' writes with torch's distributed checkpoint: no storage_options."
            )
        self.runtime.save(self, checkpoint, filepath, self._unwrapped_optimizers())

    # ----- loading -----

    def remove_checkpoint(self, filepath: Any) -> None:
        checkpointer = self._async_checkpointer
        if checkpointer is not None and checkpointer.in_flight:  # kept until the save in flight is complete
            if self.is_global_zero:  # type: ignore[attr-defined]
                checkpointer.remove_later(storage.local(str(filepath)))
            return
        super().remove_checkpoint(filepath)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.finish_checkpoint()
        self._settle_params()  # loading writes the buffers in place
        if checkpoint_io.is_sharded_checkpoint(checkpoint_path):
            return self.runtime.load(self, checkpoint_path, self._unwrapped_optimizers())
        if storage.isdir(str(checkpoint_path)):
            raise FileNotFoundError(
                f"ckpt_path={str(checkpoint_path)!r} is a folder but not a sharded checkpoint (no .metadata and "
                "meta.pt in it): give the folder a save wrote, or a checkpoint file."
            )
        return checkpoint_io.load_file(checkpoint_path)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.model is not None
        if checkpoint.get(LOADED_IN_PLACE):
            return
        skip = unsaved_keys(self.lightning_module)  # left out of the save (a frozen base): kept as it is
        state = {k: v for k, v in checkpoint["state_dict"].items() if k not in skip}
        if self._split() is not None:  # this rank's stages only
            mine = set(self.model.state_dict())
            state = {k: v for k, v in state.items() if k in mine}
        if skip and strict:
            missing = sorted(set(self.model.state_dict()) - skip - set(state))
            if missing:
                raise ValueError(
                    f"the checkpoint lacks the trained tensors {missing[:4]}: resume with the model that saved it."
                )
        load_full_model_state_dict(self.model, state, strict=strict and not skip)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.model is not None
        if checkpoint.get(LOADED_IN_PLACE):
            return
        optimizers = self.optimizers  # type: ignore[attr-defined]
        states = list(checkpoint["optimizer_states"])
        if self._split() is not None:
            states = [
                pipeline_local_optimizer_state(full, self._local_param_names(o), self._split(), self._pp_group())
                for o, full in zip(optimizers, states)
            ]
        for optimizer, state in zip(optimizers, states):
            flat = self._flat_of(optimizer)
            if flat is not None:
                load_flat_full_state_dict(flat, state)
            else:
                load_full_optimizer_state_dict(self.model, unwrap_optimizer(optimizer), state)

    def _local_param_names(self, optimizer: Any) -> list[list[str]]:
        """The parameter names of each of ``optimizer``'s groups, as configure_optimizers built them."""
        assert self.model is not None
        names: dict[int, str] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        groups = self.sharding.param_groups(unwrap_optimizer(optimizer))  # type: ignore[attr-defined]
        return [[names[id(p)] for p in group] for group in groups]
