"""MeshStrategy: the Trainer's front door, an adapter over the runtime. It owns no parallelism of its own.

Everything a layout has and does is its ``runtime``'s (:class:`~lightning_parallel.strategies.runtime.MeshRuntime`,
the object Fabric's :class:`~lightning_parallel.fabric.strategy.MeshFabricStrategy` holds too): settings and degrees,
the mesh and the sharding, the checks, the split (:func:`~lightning_parallel.parallel.parallelize.parallelize`), the
step's gradient reduction, clipping by the whole model's norm, the batch split, the sharded folders. This class
turns Lightning's hooks into the runtime's calls, wires a pipelined model's steps to its schedule
(:mod:`.pipelined_step`), and makes each of Lightning's checkpoint hooks one call into :mod:`.checkpointing`'s
functions (over the runtime and what this class names: model, module, optimizers, format); the process group and the
collectives are :class:`~lightning_parallel.strategies.distributed.DistributedHooks`'s, shared with Fabric.

The strategies themselves (:mod:`.hybrid3d`, :mod:`.zero`) are presets over
:class:`~lightning_parallel.parallel.config.ParallelConfig`. Where the model is built and placed (the meta device
under pp, tp and ZeRO-3: no rank holds a whole copy) is :mod:`.model_setup`'s.

May import: Lightning, ``lightning_parallel.parallel``, ``lightning_parallel.plugins``, ``lightning_parallel._compat``
and the modules of this package below it (launcher, checks, checkpointing, pipelined_step).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import _compat
from lightning_parallel.parallel import strict
from lightning_parallel.parallel.checkpoint.async_save import AsyncCheckpointer
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.powersgd import embedding_weights
from lightning_parallel.parallel.expert.aux import aux_loss_scale
from lightning_parallel.parallel.optim.muon import check_muon_precision
from lightning_parallel.plugins.precision import loss_scale_of, to_mesh_precision
from lightning_parallel.strategies import checkpointing
from lightning_parallel.strategies.checkpointing import check_async_save, check_checkpoint_format, unwrap_optimizer
from lightning_parallel.strategies.distributed import DistributedHooks
from lightning_parallel.strategies.fault_tolerant_step import fault_tolerant_step, start_replicas
from lightning_parallel.strategies.model_setup import ModelPlacement, sync_batchnorm_over_batch, sync_metrics_over_batch
from lightning_parallel.strategies.pipelined_step import pipelined_step
from lightning_parallel.strategies.runtime import MeshRuntime
from lightning_parallel.strategies.sharded_checkpoint import CheckpointTarget, finish_async


class MeshStrategy(ModelPlacement, DistributedHooks, ParallelStrategy):
    """Base of the strategies that lay the world out on one mesh, as a :class:`ParallelConfig` says.

    Args:
        config: the parallel settings (see :class:`~lightning_parallel.parallel.config.ParallelConfig`); its
            fields may also be given as keyword arguments (they override the config's).
        checkpoint_format: ``"sharded"`` (default: a folder per checkpoint, every rank writes its pieces, any
            layout resumes it) or ``"full"`` (one file gathered on rank 0 in the single-process format).
        async_save: sharded saves during fit go on in a thread once staged on the host (one at a time; a
            folder appears only complete): :mod:`lightning_parallel.parallel.checkpoint.async_save`.
        timeout: a ``timedelta`` or seconds (Lightning's default: 30 minutes) bounding every collective, on the
            world and on every group the strategy makes (torch would give a new NCCL group 10 minutes): when a rank
            fails, the others end within it and name the rank that failed first (``parallel/failure.py``).
        accelerator: Lightning's (as are ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
            ``precision_plugin`` and ``process_group_backend``).
    """

    strategy_name = "mesh"

    def __init__(
        self,
        config: ParallelConfig | None = None,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        checkpoint_format: str = "sharded",
        async_save: bool = False,
        **settings: Any,
    ) -> None:
        check_checkpoint_format(checkpoint_format)
        check_async_save(async_save, checkpoint_format)
        name, owner = self._name(), type(self).__name__
        self.runtime = MeshRuntime.create(owner, name, config, settings, timeout, rank_zero_warn, process_group_backend)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        self.checkpoint_format, self.async_save = checkpoint_format, async_save
        self._pipelined: Any = None  # PipelinedStep under pp > 1
        self._replicas: Any = None  # fault_tolerance='torchft': this rank's FaultTolerantReplicas
        self._async_checkpointer: AsyncCheckpointer | None = None  # async_save: the saver, created at the first save

    @property
    def replicas(self) -> Any:
        """``fault_tolerance='torchft'``: this rank's :class:`~lightning_parallel.parallel.fault_tolerance.
        FaultTolerantReplicas` (committed steps, groups in the quorum) once fit has set up; else None."""
        return self._replicas

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # states load into the sharded model and wrapped optimizers

    def check_model(self, model: Any) -> None:
        """Refuse a model this layout cannot split, in the calling process: before Lightning's launcher starts
        the other ranks and before any process group exists (``connect`` runs it too, for torchrun)."""
        self.runtime.check(model, self.parallel_dims)

    @override
    def connect(self, model: Any) -> None:
        self.check_model(model)
        super().connect(model)

    # ----- the model -----

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.runtime.split_model is not self.model:  # validate/test after fit reuse the split model
            self._sync_batchnorm_over_batch()  # before tp, pp and ZeRO-3 wrap the BatchNorms' parameters
            self._split_model()  # and placed on the device
            sync_metrics_over_batch(self.model, self.mesh.group("batch"))
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.sharding.powersgd is not None:  # embeddings and weights tied across stages travel whole
                tied = self.runtime.applied.tied if self.runtime.applied is not None else None
                self.sharding.powersgd.keep_whole(embedding_weights(self.model) + (tied.params() if tied else []))
            for optimizer in self.optimizers:
                check_muon_precision(optimizer, str(getattr(self.precision_plugin, "precision", "")))
                self.sharding.shard_optimizer(optimizer)
            self._replicas = self._replicas or start_replicas(self, trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
        self._hide_example_input()

    def _split_model(self) -> None:
        """Split ``self.model`` in place (the runtime's split), before ``configure_optimizers`` sees its parameters;
        under pp the module's steps drive the schedule."""
        module = self.lightning_module
        assert module is not None and self.model is not None
        applied = self.runtime.split(self.model, module, self.root_device, warn=rank_zero_warn, info=rank_zero_info)
        if applied.split is not None:
            self._pipelined = pipelined_step(self, module, applied.split, self.parallel_dims.tp > 1)

    def _hide_example_input(self) -> None:
        """Lightning's model summary (and TensorBoard's graph) run ``example_input_array`` through the model on
        rank 0 only: once the model is sharded or split, that forward starts collectives no other rank joins
        (seen as a crash at exit, or steps paired with the wrong collectives). Hidden until teardown."""
        module = self.lightning_module
        if module is None or self.world_size == 1 or module.example_input_array is None:
            return
        self._hidden_example_input = module.example_input_array
        module.example_input_array = None

    def _sync_batchnorm_over_batch(self) -> None:
        assert self.model is not None
        batch = self.mesh.group("batch")
        self.model = sync_batchnorm_over_batch(self.model, self._layer_sync, self.config, batch, rank_zero_warn)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    # ----- precision, gradients, clipping -----

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = to_mesh_precision(Precision(), self._name(), self.clip_grad_norm)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = (
            None if plugin is None else to_mesh_precision(plugin, self._name(), self.clip_grad_norm)
        )

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm of the whole model's gradient, however it is split; returns that norm."""
        return self.runtime.clip(unwrap_optimizer(optimizer), max_norm, norm_type)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        raw = unwrap_optimizer(optimizer)

        def closure_then_reduce() -> Any:
            if self._pipelined is None:  # this closure's backward is the step's last: reduce as it goes
                self.sharding.before_last_backward(raw)
            else:  # the schedule arms each stage's buckets before its last microbatch's backward
                self._pipelined.arm_last_backward(self.sharding, raw)
            self.runtime.new_backward()
            result = closure()
            self.runtime.reduce_gradients(raw)  # once per step, after its last backward, before clipping
            return result

        if self._replicas is not None:  # fault_tolerance='torchft': across the replica groups alive now
            grads = lambda: [g for g, _, _ in self.sharding.grad_pieces(raw)]  # noqa: E731
            step = lambda done: super(MeshStrategy, self).optimizer_step(optimizer, done, model, **kwargs)  # noqa: E731
            result = fault_tolerant_step(
                self._replicas, self.lightning_module.trainer, raw, closure_then_reduce, step, grads
            )
        else:
            result = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        self.sharding.after_step(raw)
        return result

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipelined is not None:
            # the schedule ran forward and backward inside the training step; hand over its gradients
            assert self.lightning_module is not None
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
            self._pipelined.apply_gradients()
            closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
            self.post_backward(closure_loss)
            return closure_loss
        # MoE auxiliary losses get the gradient the main loss has: fp16 scale, divided by the accumulation steps
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        with aux_loss_scale(loss_scale_of(self.precision_plugin) / accumulate), self.runtime.loss_context():
            # under tp the vocabulary-parallel loss needs its own backward rules too
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ----- steps -----

    def _step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None and self.model is not None
        with context:
            if args:  # cp, spatial: this rank's part of each sample
                args = (self.runtime.shard_batch(args[0]), *args[1:])
            applied = self.runtime.applied
            if applied is not None and applied.route_through_root:
                # call the module itself so the sharded root's forward hooks gather its parameters
                return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)
            return getattr(self.lightning_module, name)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    @override
    def on_train_end(self) -> None:
        self.sharding.settle_params()  # overlap_grad_reduce: the last step's gathers land before anyone reads

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        checkpointer, self._async_checkpointer = self._async_checkpointer, None  # the save in flight lands first
        checkpointing.close_async(checkpointer, self.world_size, self._trainer())
        if self._replicas is not None:
            self._replicas.shutdown()
            self._replicas = None
        self.end_failure_watch()
        hidden = self.__dict__.pop("_hidden_example_input", None)
        if hidden is not None and self.lightning_module is not None:
            self.lightning_module.example_input_array = hidden
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        if sys.exc_info()[0] is None:  # a run that ended normally: every rank got here (strict mode's check)
            strict.check("the end of the Trainer run")
        else:  # ended on an error: the ranks may have stopped at different collectives
            strict.discard()

    # ----- checkpoints: one call each into strategies/checkpointing.py -----

    def _trainer(self) -> Any:
        return _compat.attached_trainer(self.lightning_module) if self.lightning_module is not None else None

    def async_checkpointer(self, create: bool = True) -> AsyncCheckpointer | None:
        """The asynchronous saver while ``async_save`` and fitting (a save outside fit is written before it
        returns); None otherwise. ``create=False``: the one there is, if any."""
        if not create or not checkpointing.saves_async(self.async_save, self._trainer()):
            return None if create else self._async_checkpointer
        if self._async_checkpointer is None:
            self._async_checkpointer = AsyncCheckpointer(self.global_rank, self.world_size, self.runtime.timeout)
        return self._async_checkpointer

    def finish_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight (collective); every rank raises alike if it failed."""
        finish_async(self._async_checkpointer, self.world_size)

    def _target(self, checkpointer: AsyncCheckpointer | None = None) -> CheckpointTarget:
        assert self.model is not None
        optimizers = [unwrap_optimizer(o) for o in self.optimizers]
        rank, world, module = self.global_rank, self.world_size, self.lightning_module
        return self.runtime.target(self.model, module, optimizers, rank, world, checkpointer)

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, Any]:
        """The whole model's state in the single-process format, on rank 0 (collective; every stage's layers);
        ``trainable_only``: without the frozen parameters (never gathered)."""
        assert self.model is not None
        return checkpointing.full_state_dict(self.runtime, self.model, trainable_only)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return checkpointing.module_state_dict(self.runtime, self.model, self.lightning_module, self.checkpoint_format)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        return checkpointing.optimizer_state(self.runtime, self.model, optimizer, self.checkpoint_format)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        checkpointing.settle_params(self.runtime)
        if self.checkpoint_format == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "checkpoint_format='sharded' writes with torch's distributed checkpoint: no storage_options."
            )
        self.runtime.save(self._target(self.async_checkpointer()), checkpoint, filepath)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not checkpointing.remove_later(self._async_checkpointer, filepath, self.is_global_zero):
            super().remove_checkpoint(filepath)  # else kept until the save in flight is complete

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.finish_checkpoint()
        return checkpointing.load_checkpoint(self.runtime, self._target, checkpoint_path)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.model is not None
        checkpointing.load_model_state(self.runtime, self.model, self.lightning_module, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        assert self.model is not None
        checkpointing.load_optimizer_states(self.runtime, self.model, self.optimizers, checkpoint)
