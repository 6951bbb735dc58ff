"""MeshFabricStrategy: the mesh strategies under Lightning Fabric, an adapter over the Trainer's runtime.

Everything a layout has and does is its ``runtime``'s (:class:`~lightning_parallel.strategies.runtime.MeshRuntime`,
the object the Trainer's :class:`~lightning_parallel.strategies.base.MeshStrategy` holds too): the settings and
degrees, the mesh and sharding, the checks, the split, the step's reduction, clipping, the batch split, the sharded
folders (:mod:`.checkpoint`). The process group, collectives and failures are functions both doors call
(:mod:`lightning_parallel.strategies.distributed`), as is where the model is built
(:mod:`lightning_parallel.strategies.model_setup`). What differs is only where Fabric calls in:

- ``fabric.setup(model, optimizer)``: the optimizer was built over the unsplit model's parameters; they are
  re-pointed by name at what the split left on this rank before the sharding takes the optimizer.
- ``fabric.backward`` runs as often as the loop accumulates; the data-parallel reduction runs once per optimizer
  step, at whichever of ``fabric.clip_gradients`` and ``optimizer.step()`` comes first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.model_parallel import _ParallelBackwardSyncControl
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import _compat
from lightning_parallel.fabric import checkpoint
from lightning_parallel.fabric.full_state import accept_whole_state
from lightning_parallel.fabric.optimizers import repoint
from lightning_parallel.fabric.pipeline import (
    LossFn,
    as_inputs,
    build_pipeline,
    loss_of,
    pipelined_loss,
    unpipelined_loss,
)
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.materialize import splits_model
from lightning_parallel.parallel.pipeline.runner import Pipeline
from lightning_parallel.plugins.precision import loss_scaler_like
from lightning_parallel.strategies import distributed
from lightning_parallel.strategies.model_setup import built_on_meta, moves_whole
from lightning_parallel.strategies.runtime import MeshRuntime


def check_fabric_config(config: ParallelConfig, owner: str) -> None:
    """What the Fabric strategies do not run yet, refused before any process starts."""
    if config.overlap_grad_reduce:
        raise ValueError(
            f"{owner}(overlap_grad_reduce=True) is not available in Fabric (it needs to know which backward is a "
            "step's last): set overlap_grad_reduce=False, or train with the Trainer."
        )
    if config.fault_tolerance != "none":
        raise ValueError(
            f"{owner}(fault_tolerance={config.fault_tolerance!r}) runs under the Trainer only for now (it steps the "
            "optimizer only when torchft commits): train with Trainer(strategy=Hybrid3DStrategy(...)), or drop it."
        )


@distributed.door_views  # the layout, the per-process bookkeeping, barrier/broadcast/vote: shared
class MeshFabricStrategy(ParallelStrategy):
    """Base of the Fabric strategies that lay the world out on one mesh, as a :class:`ParallelConfig` says.

    Args:
        config: the parallel settings (see :class:`~lightning_parallel.parallel.config.ParallelConfig`); its
            fields may also be given as keyword arguments (they override the config's).
        timeout: a ``timedelta`` or seconds bounding every collective.
        prepare_model: called with the model at ``fabric.setup``, before the checks and the split: gives a model
            that lacks them the protocol methods the layout needs (LitGPT's ``GPT`` in LitGPT's own scripts:
            :func:`lightning_parallel.litgpt.fabric.litgpt_protocol`).
        accelerator, parallel_devices, cluster_environment, precision, process_group_backend: Fabric's.
    """

    strategy_name = "mesh"
    calls_materialize = True  # protocol.strategy_calls_materialize: each rank's pieces filled through materialize()
    is_distributed = True  # else Lightning adds no DistributedSampler and sync_dist does nothing

    def __init__(
        self,
        config: ParallelConfig | None = None,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        prepare_model: Callable[[nn.Module], Any] | None = None,
        **settings: Any,
    ) -> None:
        owner = type(self).__name__
        self.runtime = MeshRuntime.create(
            owner, self.strategy_name, config, settings, timeout, rank_zero_warn, process_group_backend
        )
        check_fabric_config(self.config, owner)
        self.prepare_model = prepare_model
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._num_nodes = 1
        self._pipeline: Pipeline | None = None  # this rank's stages under the schedule (pp > 1)
        self._names: dict[int, str] = {}  # the unsplit model's parameters by id: optimizers are re-pointed by name
        self._optimizers: list[Optimizer] = []
        self._backward_sync_control = _ParallelBackwardSyncControl()  # ZeRO-3's FSDP2 units skip their reduction

    @property
    def module(self) -> nn.Module | None:
        """The model ``fabric.setup`` split (None before)."""
        return self.runtime.split_model

    # ----- Fabric's bookkeeping, the processes: one call each into strategies/distributed.py -----

    @override
    def setup_environment(self) -> None:
        distributed.check_launched_world(self.cluster_environment, self.num_nodes, self.num_processes)
        super().setup_environment()
        distributed.start_rank(self, self._precision_name())

    def _precision_name(self) -> str | None:
        return getattr(self.precision, "precision", None)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    def _set_world_ranks(self) -> None:
        self.set_world_ranks()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # bad degrees fail here, before any process starts; tp, cp, dp_shard inside a node
        self.runtime.degrees(self.world_size, self.num_processes, self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        if isinstance(precision, MixedPrecision) and precision.precision == "16-mixed":
            # torch's GradScaler decides on overflow per rank and cannot unscale DTensor gradients: the Trainer's
            # scaler (same settings, one verdict for the whole mesh) in its place
            precision.scaler = loss_scaler_like(precision.scaler, precision.device)
        self._precision = precision

    # ----- building and splitting the model -----

    @override
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``fabric.init_module()``: on the meta device under a layout that splits the model (each rank then
        materializes only its pieces, with the values one process draws); else on the device, always with values
        (``empty_init`` changes nothing, as under the Trainer: the values never depend on the layout)."""
        if not splits_model(self.config):
            return super().module_init_context(empty_init=False)
        return built_on_meta(self.runtime, self.precision.module_init_context())

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        if not splits_model(self.config):
            return super().tensor_init_context()
        return built_on_meta(self.runtime, self.precision.tensor_init_context())

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Whole onto the device only when every rank holds all of it (else each rank's pieces, once split)."""
        if moves_whole(self.config, module):
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Check ``module`` against the layout, then split it in place (:func:`parallelize`)."""
        if self.module is not None:
            raise ValueError(
                f"{type(self).__name__} sets up one model: call fabric.setup once, or use one Fabric per model."
            )
        if self.prepare_model is not None:
            self.prepare_model(module)
        self.runtime.check(module, self.parallel_dims)
        whole_keys = set(module.state_dict())
        self._names = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), name)
        applied = self.runtime.split(module, module, self.root_device, warn=rank_zero_warn, info=rank_zero_info)
        if applied.split is not None:  # pp: pipeline_step runs the stages
            self._pipeline = build_pipeline(self, module, applied.split)
        accept_whole_state(module, whole_keys - set(module.state_dict()))  # model.load_state_dict(single-process)
        self.barrier()
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Re-point ``optimizer`` at the split model's parameters (by name), then let the sharding take it."""
        if self.module is None:
            raise ValueError("set up the model first: fabric.setup(model, optimizer) or fabric.setup_module(model).")
        repoint(optimizer, self.module, self.runtime.stages, self._names, type(self).__name__)
        self.runtime.take_optimizers(self.module, [optimizer], str(getattr(self.precision, "precision", "")))
        _compat.optimizers_to_device([optimizer], self.root_device)
        self._optimizers.append(optimizer)
        return optimizer

    # ----- gradients and steps -----

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.runtime.new_backward()  # the step's gradients are not reduced yet
        # under tp the vocabulary-parallel loss needs its own backward rules. MoE auxiliary losses get the factor a
        # loop sets around its backward with parallel.expert.aux.aux_loss_scale (1 by default), as in one process
        with self.runtime.loss_context():
            super().backward(tensor, module, *args, **kwargs)

    def pipeline_step(
        self,
        model: nn.Module,
        inputs: Any,
        target: Any,
        loss_fn: LossFn | None = None,
        *,
        scale: float = 1.0,
        **kwargs: Any,
    ) -> Tensor:
        """Forward and backward of one batch: under pp every microbatch's, under the configured schedule
        (``pp_schedule``, ``microbatches``); without pp ``loss_fn(model(*inputs), target)`` and
        ``fabric.backward``. The gradients of ``loss * scale`` add up in the parameters as after
        ``fabric.backward(loss * scale)``; returns the batch's loss (detached; under pp the mean of the
        microbatches' losses, the same on every pp rank).

        Args:
            model: the model ``fabric.setup`` returned (or the module inside it).
            inputs: the model's positional inputs: one tensor, or a tuple of them.
            target: what ``loss_fn`` compares the output with (cut into microbatches as ``inputs`` are).
            loss_fn: ``loss_fn(output, target)``, a mean over the samples; None: the model's own ``loss``.
            scale: the factor of the loss backpropagated (``1 / accumulate`` under gradient accumulation).
            **kwargs: keyword inputs of the model (each stage reads its microbatch's with
                :func:`~lightning_parallel.parallel.pipeline.runner.stage_inputs`).
        """
        module = getattr(model, "module", model)  # Fabric's wrapper, or the module
        if self.module is None or module is not self.module:
            raise ValueError(
                f"{type(self).__name__}.pipeline_step runs the model set up with fabric.setup: pass it (or "
                "fabric.setup(model, optimizer) first)."
            )
        self.runtime.new_backward()  # the step's gradients are not reduced yet
        args = as_inputs(inputs)
        if self._pipeline is None:
            return unpipelined_loss(self, module, args, kwargs, target, loss_fn, scale)
        loss = loss_of(module, loss_fn, type(self).__name__)
        return pipelined_loss(self, self._pipeline, args, kwargs, target, loss, scale)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm of the whole model's gradient, however it is split; returns that norm."""
        self.runtime.reduce_gradients(optimizer)  # once per step, at clipping or the step, whichever comes first
        self.precision.unscale_gradients(optimizer)
        norm = self.runtime.clip(optimizer, float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of the gradients is {norm.item()}: clipping cannot make it finite.")
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.runtime.reduce_gradients(optimizer)
        self.precision.unscale_gradients(optimizer)
        for grad, _, _ in self.sharding.grad_pieces(optimizer):
            grad.clamp_(-clip_val, clip_val)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.runtime.reduce_gradients(optimizer)
        result = self.precision.optimizer_step(optimizer, **kwargs)
        self.sharding.after_step(optimizer)
        return result

    def shard_batch(self, batch: Any) -> Any:
        """This rank's piece of every sample in ``batch`` under cp (sequence chunks) or spatial (image strips);
        the batch itself otherwise. A Fabric loop calls it on each batch before the forward."""
        return self.runtime.shard_batch(batch)

    # ----- collectives -----

    @override
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Over the ``loss`` role by default (the data-parallel ranks and cp), as the Trainer's ``reduce``: tensor
        shards hold the same values."""
        return distributed.reduce(self.runtime, tensor, group, reduce_op)

    # ----- checkpoints -----

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        """A sharded folder in the Trainer strategies' format (any layout, and the Trainer, resume it)."""
        checkpoint.save(self, path, state, storage_options, filter)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """``state``'s model and optimizers from a sharded folder; a model alone from a state dict file (load_raw)."""
        return checkpoint.load(self, path, state, strict)

    @override
    def teardown(self) -> None:
        self.runtime.end_watch()
        super().teardown()
