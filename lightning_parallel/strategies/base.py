"""MeshStrategy: the Trainer's front door, an adapter over its ``runtime`` (:class:`~.runtime.MeshRuntime`, which
Fabric's door holds too). Lightning's hooks become calls of the runtime and of the functions both doors share
(Lightning's way between its Trainer and Fabric strategies, not mixins): :mod:`.distributed`, :mod:`.model_setup`,
:mod:`.checkpointing`, :mod:`.trainer_step`, :mod:`.pipelined_step`. Presets: :mod:`.hybrid3d`, :mod:`.zero`.

May import: Lightning, ``lightning_parallel.parallel``, ``lightning_parallel.plugins``, ``lightning_parallel._compat``
and the modules of this package below it.
"""

from __future__ import annotations

import contextlib
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
from lightning_parallel.parallel.materialize import splits_model
from lightning_parallel.plugins.precision import to_mesh_precision
from lightning_parallel.strategies import checkpointing, distributed, model_setup, trainer_step
from lightning_parallel.strategies.checkpointing import check_async_save, check_checkpoint_format, unwrap_optimizer
from lightning_parallel.strategies.fault_tolerant_step import start_replicas
from lightning_parallel.strategies.pipelined_step import pipelined_step
from lightning_parallel.strategies.runtime import MeshRuntime
from lightning_parallel.strategies.sharded_checkpoint import CheckpointTarget


@distributed.door_views  # the layout, the per-process bookkeeping, barrier/broadcast/vote: shared
class MeshStrategy(ParallelStrategy):
    """Base of the strategies that lay the world out on one mesh, as a :class:`ParallelConfig` says.

    Args:
        config: the parallel settings (see :class:`~lightning_parallel.parallel.config.ParallelConfig`); its
            fields may also be given as keyword arguments (they override the config's).
        checkpoint_format: ``"sharded"`` (default: a folder per checkpoint, every rank writes its pieces, any
            layout resumes it) or ``"full"`` (one file gathered on rank 0 in the single-process format).
        async_save: sharded saves during fit go on in a thread once staged on the host (one at a time; a
            folder appears only complete): :mod:`lightning_parallel.parallel.checkpoint.async_save`.
        timeout: a ``timedelta`` or seconds (default 30 minutes) bounding every collective, on the world and every
            group: when a rank fails, the others end within it and name the rank that failed first.
        accelerator: Lightning's (as are ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
            ``precision_plugin`` and ``process_group_backend``).
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
        owner = type(self).__name__
        self.runtime = MeshRuntime.create(
            owner, self.strategy_name, config, settings, timeout, rank_zero_warn, process_group_backend
        )
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.num_nodes = 1
        self.checkpoint_format, self.async_save = checkpoint_format, async_save
        self._pipelined: Any = None  # PipelinedStep under pp > 1
        self._replicas: Any = None  # fault_tolerance='torchft': this rank's FaultTolerantReplicas
        self.saves = checkpointing.AsyncSaves()  # async_save: the saver, created at the first save during fit
        self._hidden_example_input: Any = None  # the module's example_input_array while the model is split

    @property
    def replicas(self) -> Any:
        """``fault_tolerance='torchft'``: this rank's ``FaultTolerantReplicas`` once fit has set up; else None."""
        return self._replicas

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:  # states load into the sharded model and wrapped optimizers
        return True

    def check_model(self, model: Any) -> None:
        """Refuse a model this layout cannot split before any process group exists (the launcher; torchrun: connect)."""
        self.runtime.check(model, self.parallel_dims)

    @override
    def connect(self, model: Any) -> None:
        self.check_model(model)
        super().connect(model)

    # ----- the model -----

    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``Trainer.init_module()``: on meta under a layout that splits the model (:mod:`.model_setup`)."""
        if not splits_model(self.config):
            return super().tensor_init_context(empty_init)
        return model_setup.built_on_meta(self.runtime, self.precision_plugin.tensor_init_context())

    @override
    def model_sharded_context(self) -> contextlib.AbstractContextManager:
        return model_setup.built_on_meta(self.runtime) if splits_model(self.config) else contextlib.nullcontext()

    @override
    def model_to_device(self) -> None:
        """Whole onto the device only when every rank holds all of it (else the runtime's split places it)."""
        assert self.model is not None
        if model_setup.moves_whole(self.config, self.model):
            self.model.to(self.root_device)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.runtime.split_model is not self.model:  # validate/test after fit reuse the split model
            batch, sync = self.mesh.group("batch"), self._layer_sync  # BatchNorm synced before tp, pp, ZeRO-3 wrap it
            self.model = model_setup.sync_batchnorm_over_batch(self.model, sync, self.config, batch, rank_zero_warn)
            module = self.lightning_module  # split in place before configure_optimizers sees its parameters
            applied = self.runtime.split(self.model, module, self.root_device, rank_zero_warn, rank_zero_info)
            if applied.split is not None:  # pp: the module's steps drive the schedule
                self._pipelined = pipelined_step(self, module, applied.split, self.parallel_dims.tp > 1)
            model_setup.sync_metrics_over_batch(self.model, batch)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            raws = [unwrap_optimizer(o) for o in self.optimizers]
            self.runtime.take_optimizers(self.model, raws, str(getattr(self.precision_plugin, "precision", "")))
            self._replicas = self._replicas or start_replicas(self, trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
        if self.world_size > 1 and self._hidden_example_input is None:  # see hide_example_input
            self._hidden_example_input = model_setup.hide_example_input(self.lightning_module)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    # ----- precision, gradients, clipping -----

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = to_mesh_precision(Precision(), self.strategy_name, self.clip_grad_norm)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = plugin and to_mesh_precision(plugin, self.strategy_name, self.clip_grad_norm)

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm of the whole model's gradient, however it is split; returns that norm."""
        return self.runtime.clip(unwrap_optimizer(optimizer), max_norm, norm_type)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        step = lambda done: super(MeshStrategy, self).optimizer_step(optimizer, done, model, **kwargs)  # noqa: E731
        pipelined, replicas = self._pipelined, self._replicas
        return trainer_step.optimizer_step(self.runtime, optimizer, closure, step, pipelined, replicas, self._trainer())

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipelined is not None:  # the schedule ran forward and backward inside the training step
            return self._pipelined.hand_over(self, closure_loss)
        with trainer_step.backward_context(self.runtime, self._trainer(), self.precision_plugin):
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
        self.saves.close(self.world_size, self._trainer())  # the save in flight lands first
        if self._replicas is not None:
            self._replicas.shutdown()
            self._replicas = None
        self.runtime.end_watch()  # this rank's work ended normally: stop watching, and say so on the board
        model_setup.show_example_input(self.lightning_module, self._hidden_example_input)
        self._hidden_example_input = None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        if sys.exc_info()[0] is None:  # a run that ended normally: every rank got here (strict mode's check)
            strict.check("the end of the Trainer run")
        else:  # ended on an error: the ranks may have stopped at different collectives
            strict.discard()

    # ----- the processes: one call each into strategies/distributed.py -----

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = distributed.launcher(self)

    @override
    def setup_environment(self) -> None:
        distributed.check_launched_world(self.cluster_environment, self.num_nodes, self.num_processes)
        super().setup_environment()
        distributed.start_rank(self, self._precision_name(), self._trainer())

    def _precision_name(self) -> str | None:
        return getattr(self.precision_plugin, "precision", None)

    @override
    def on_exception(self, exception: BaseException) -> None:
        distributed.on_failure(self, exception)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return distributed.reduce(self.runtime, tensor, group, reduce_op)

    # ----- checkpoints: one call each into strategies/checkpointing.py -----

    def _trainer(self) -> Any:
        return _compat.attached_trainer(self.lightning_module) if self.lightning_module is not None else None

    def async_checkpointer(self, create: bool = True) -> AsyncCheckpointer | None:
        """The asynchronous saver while ``async_save`` and fitting (a save outside fit is written before it
        returns); None otherwise. ``create=False``: the one there is, if any."""
        if not create:
            return self.saves.checkpointer
        rank, world, timeout = self.global_rank, self.world_size, self.runtime.timeout
        return self.saves.saver(self.async_save, self._trainer(), rank, world, timeout)

    def finish_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight (collective); every rank raises alike if it failed."""
        self.saves.finish(self.world_size)

    def _target(self, checkpointer: AsyncCheckpointer | None = None) -> CheckpointTarget:
        assert self.model is not None
        optimizers = [unwrap_optimizer(o) for o in self.optimizers]
        rank, world, module = self.global_rank, self.world_size, self.lightning_module
        return self.runtime.target(self.model, module, optimizers, rank, world, checkpointer)

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, Any]:
        """The whole model's state in the single-process format, on rank 0 (collective; every stage's layers);
        ``trainable_only``: without the frozen parameters (never gathered)."""
        return checkpointing.full_state_dict(self.runtime, self.model, trainable_only)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return checkpointing.module_state_dict(self.runtime, self.model, self.lightning_module, self.checkpoint_format)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
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
        if not checkpointing.remove_later(self.saves.checkpointer, filepath, self.is_global_zero):
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
