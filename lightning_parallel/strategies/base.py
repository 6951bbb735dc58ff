"""What every mesh strategy shares: process group and mesh set-up, dp-only sampling and reduction,
steps routed through sharded roots, gradient reduction before clipping, global-norm clipping, and
checkpoints (sharded folders, or one file in the single-process format)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.module import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_parallel.mesh import DP, MESH_AXES, ParallelDims
from lightning_parallel.parallel import checkpoint_io
from lightning_parallel.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    check_activation_checkpointing,
)
from lightning_parallel.parallel.clip import GradPart, clip_grad_norm_, dtensor_grad_parts
from lightning_parallel.parallel.data_parallel import all_reduce_gradients
from lightning_parallel.parallel.fsdp import apply_fsdp
from lightning_parallel.parallel.state_dict import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from lightning_parallel.parallel.sync_batchnorm import convert_sync_batchnorm
from lightning_parallel.parallel.zero import FlatZero, check_shardable_optimizer
from lightning_parallel.strategies import checkpointing
from lightning_parallel.strategies.checkpointing import check_checkpoint_format
from lightning_parallel.strategies.failure import (
    FailureBoard,
    annotate,
    end_children,
    is_collective_failure,
    to_timeout,
)
from lightning_parallel.strategies.layer_sync import DataParallelSyncBatchNorm
from lightning_parallel.strategies.precision import to_mesh_precision


class _CheckFirstLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher, after the strategy has checked the model in this process."""

    def __init__(self, strategy: MeshStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        model = args[0] if args else None  # fit, validate, test and predict take the model first
        if isinstance(model, LightningModule):
            self._strategy.check_model(model)
        return super().launch(function, *args, trainer=trainer, **kwargs)


# every rank reduces every combination, present or not, so all ranks issue the same collectives
_AXIS_COMBOS = [c for n in (1, 2, 3) for c in itertools.combinations(sorted(MESH_AXES), n)]


def _split_axes(param: torch.Tensor) -> tuple[str, ...]:
    """Mesh axes over which a (DTensor) parameter is sharded; () for a replicated one."""
    if not isinstance(param, DTensor):
        return ()
    names = param.device_mesh.mesh_dim_names or ()
    return tuple(names[i] for i, pl in enumerate(param.placements) if not pl.is_replicate())


class MeshStrategy(ParallelStrategy):
    """Base of the strategies that lay the world out on one (pp, dp, tp) device mesh.

    Subclasses say how the world splits (:meth:`_parallel_degrees`) and how the model is split over the
    tp and pp axes (:meth:`_apply_model_parallel`); this class shards it over dp with ZeRO stage
    ``zero_stage`` (0: gradients averaged; 1: + optimizer states sharded; 2: + gradients; 3: +
    parameters, with FSDP2). ``activation_checkpointing`` (``"none"``, ``"full"``, ``"selective"``) recomputes
    each layer's activations in backward; it is applied after tp and pp, before ZeRO-3.
    ``checkpoint_format`` is ``"sharded"`` (default: a folder per checkpoint, every rank writes its pieces,
    any layout resumes it) or ``"full"`` (one file gathered on rank 0 in the single-process format).
    ``timeout`` (a ``timedelta`` or seconds; torch's default: 30 minutes) bounds every collective: when a rank
    fails, the others end within it and name the rank that failed first (see ``strategies/failure.py``).
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        zero_stage: int = 0,
        offload: bool = False,
        reshard_after_forward: bool = True,
        checkpoint_format: str = "sharded",
        activation_checkpointing: str = "none",
    ) -> None:
        check_checkpoint_format(checkpoint_format)
        self.activation_checkpointing = check_activation_checkpointing(activation_checkpointing)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._process_group_backend = process_group_backend
        # every collective, on the world and on the mesh's axis groups, fails after this long without its peers
        self._timeout = to_timeout(default_pg_timeout if timeout is None else timeout)
        self._failures: FailureBoard | None = None
        self.num_nodes = 1
        self._dims: ParallelDims | None = None
        self._mesh: DeviceMesh | None = None
        # True when the LightningModule itself is a sharded unit whose forward hooks must run every step
        self._route_steps_through_root = False
        self._parallelized: torch.nn.Module | None = None
        self.zero_stage = zero_stage
        self.offload = offload
        self.reshard_after_forward = reshard_after_forward
        self._flat: dict[int, FlatZero] = {}  # id(optimizer) -> its ZeRO-1/2 sharding
        self.fsdp_units: list[str] = []
        self.checkpoint_format = checkpoint_format
        self._full_param_order: list[str] = []  # the unsplit model's parameter names: checkpoints number them

    # ----- what subclasses decide -----

    def _parallel_degrees(self, world_size: int) -> ParallelDims:
        raise NotImplementedError

    def _setting(self) -> str:
        """How the user named this strategy, for error messages."""
        return f"strategy={self._name()!r}"

    def _apply_model_parallel(self) -> None:
        """Split the model over the tp and pp axes, in place (before ZeRO-3 shards over dp)."""

    # ----- sharding over the dp axis: ZeRO stages 0-3 -----

    def _parallelize_model(self) -> None:
        """Shard or split ``self.model`` in place, before ``configure_optimizers`` sees its parameters."""
        assert self.model is not None
        self._apply_model_parallel()
        self._apply_activation_checkpointing()  # after tp (torchtitan's order), before ZeRO-3 wraps the layers
        if self.zero_stage == 3:
            self.fsdp_units = apply_fsdp(
                self.model,
                self.device_mesh[DP],
                reshard_after_forward=self.reshard_after_forward,
                offload=self.offload,
            )
            self._route_steps_through_root = "" in self.fsdp_units

    def _apply_activation_checkpointing(self, layers: list[torch.nn.Module] | None = None) -> None:
        """Recompute each layer's activations in backward (``activation_checkpointing``): the module's
        ``pipeline_layers()`` (or repeated blocks), or ``layers`` (this rank's pipeline stages)."""
        if self.activation_checkpointing == "none":
            return
        assert self.lightning_module is not None
        wrapped = apply_activation_checkpointing(
            self.lightning_module if layers is None else layers, self.activation_checkpointing
        )
        if not wrapped:
            rank_zero_warn(
                f"activation_checkpointing={self.activation_checkpointing!r} found no layers in "
                f"{type(self.lightning_module).__name__}: give it pipeline_layers() (see the README) or keep its "
                "repeated blocks in an nn.ModuleList; nothing is recomputed."
            )

    def _shard_optimizers(self) -> None:
        """Wrap the optimizers the user's ``configure_optimizers`` built."""
        self._flat = {}
        for optimizer in self.optimizers:
            if self.zero_stage > 0:
                check_shardable_optimizer(optimizer, self._setting())
            if self.zero_stage in (1, 2):
                group = self.device_mesh[DP].get_group()
                self._flat[id(optimizer)] = FlatZero(optimizer, group, self.zero_stage, offload=self.offload)

    def _flat_zero(self, optimizer: Optimizer) -> FlatZero | None:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self._flat.get(id(optimizer))

    def _after_backward(self, optimizer: Optimizer) -> None:
        """Runs once per optimizer step after the last backward, before clipping and the update."""
        flat = self._flat_zero(optimizer)
        if flat is not None:
            flat.reduce_gradients()
        elif self.zero_stage == 0:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            all_reduce_gradients(params, self.device_mesh[DP].get_group())

    def _grad_parts(self, optimizer: Optimizer) -> tuple[list[GradPart], list[Tensor]]:
        """This rank's gradients of ``optimizer``'s parameters, with the mesh axes that split each, and the
        gradients of tied copies that another rank counts in the norm."""
        skip, extra = self._excluded_from_norm(), self._stage_axes()
        flat = self._flat_zero(optimizer)
        if flat is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            counted = dtensor_grad_parts(p for p in params if id(p) not in skip)
            uncounted = [g for g, _ in dtensor_grad_parts(p for p in params if id(p) in skip)]
            return [(grad, (*axes, *extra)) for grad, axes in counted], uncounted
        counted, uncounted = [], []
        for grad, param in flat.shard_grad_segments():
            if id(param) in skip:
                uncounted.append(grad)
            else:
                counted.append((grad, (DP, *_split_axes(param), *extra)))
        return counted, uncounted

    def _excluded_from_norm(self) -> set[int]:
        """Ids of parameters another rank already counts in the gradient norm (tied copies)."""
        return set()

    def _stage_axes(self) -> tuple[str, ...]:
        """Mesh axes over which ranks hold different parameters altogether (pipeline stages)."""
        return ()

    # ----- mesh and process group -----

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._dims is None:
            self._dims = self._parallel_degrees(self.world_size)
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh exists once the strategy has set up its process group.")
        return self._mesh

    @property
    def axis_groups(self) -> dict[str, dist.ProcessGroup]:
        return {axis: self.device_mesh[axis].get_group() for axis in MESH_AXES}

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank of one dp index sees the same samples: pipeline stages and tensor shards share a batch
        return {"num_replicas": self.parallel_dims.dp, "rank": self.device_mesh[DP].get_local_rank()}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # states load into the sharded model and wrapped optimizers

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._dims = self._parallel_degrees(self.world_size)  # bad degrees fail here, before any process starts
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _CheckFirstLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)

    def check_model(self, model: Any) -> None:
        """Refuse a model this layout cannot split, in the calling process: before Lightning's launcher
        starts the other ranks (which would re-run the script only to fail the same way) and before any
        process group exists. Subclasses add their checks; ``connect`` runs them too (under torchrun)."""

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        dims = self.parallel_dims
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        # torch's new groups already get its default: only a timeout set by the user needs passing on
        mesh_timeout = None if self._timeout == default_pg_timeout else self._timeout
        self._mesh = dims.build_mesh(self.root_device.type, timeout=mesh_timeout)
        self._failures = FailureBoard.for_process_group()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A rank that fails leaves word of it; a rank whose collective failed names the rank that failed
        first; the process that launched the others (Lightning's launcher) gives them 5 s, then kills them."""
        if self._failures is not None and isinstance(exception, Exception):
            if is_collective_failure(exception):
                annotate(exception, self._failures.explain(), self.global_rank)
            else:
                self._failures.record(exception)
        procs = getattr(self._launcher, "procs", None)
        if procs and not isinstance(exception, SystemExit):  # SystemExit: a preemption stop, every rank exits
            end_children(procs, grace_s=min(self._timeout.total_seconds(), 5.0))

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._parallelized is not self.model:  # validate/test after fit reuse the parallel model
            # checkpoints number optimizer states as the unsplit model's parameters (what one process has)
            self._full_param_order = [name for name, _ in self.model.named_parameters()]
            self._sync_batchnorm_over_dp()  # before tp, pp and ZeRO-3 wrap the BatchNorms' parameters
            self._parallelize_model()
            self._parallelized = self.model
            self._sync_metrics_over_dp()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._shard_optimizers()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._hide_example_input()

    def _hide_example_input(self) -> None:
        """Lightning's model summary (and TensorBoard's graph) run ``example_input_array`` through the model on
        rank 0 only: once the model is sharded or split, that forward starts collectives no other rank joins
        (seen as a crash at exit, or steps paired with the wrong collectives). Hidden until teardown."""
        module = self.lightning_module
        if module is None or self.world_size == 1 or module.example_input_array is None:
            return
        self._hidden_example_input = module.example_input_array
        module.example_input_array = None

    def _sync_batchnorm_over_dp(self) -> None:
        """Apply ``Trainer(sync_batchnorm=True)`` or a ``LayerSync`` plugin: BatchNorm statistics over the dp axis.

        Lightning's ``TorchSyncBatchNorm`` (what ``sync_batchnorm=True`` sets) would use torch's SyncBatchNorm,
        which trains only on GPUs and syncs over the whole world, pp and tp ranks included (tp ranks hold other
        channels): ours syncs over the dp group on any device. A plugin with its own group, or another
        ``LayerSync``, is applied as given. Conversion is part of parallelizing: validation after fit reuses it,
        and nothing reverts it (the model stays split after fit too); eval mode runs the plain BatchNorm.
        """
        sync = self._layer_sync
        if sync is None:
            return
        assert self.model is not None
        default = type(sync) is TorchSyncBatchNorm
        if default or (isinstance(sync, DataParallelSyncBatchNorm) and sync.process_group is None):
            self.model = convert_sync_batchnorm(self.model, self.device_mesh[DP].get_group())
        else:
            self.model = sync.apply(self.model)

    def _sync_metrics_over_dp(self) -> None:
        """torchmetrics sync over the whole world by default; pp and tp ranks would count a batch twice."""
        assert self.model is not None
        group = self.device_mesh[DP].get_group()
        for module in self.model.modules():
            if isinstance(module, Metric) and module.process_group is None:
                module.process_group = group

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ----- precision and clipping -----

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

    def _name(self) -> str:
        return getattr(self, "strategy_name", type(self).__name__)

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the norm of the whole model's gradient, however it is split; returns that norm."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        counted, uncounted = self._grad_parts(optimizer)
        return clip_grad_norm_(counted, max_norm, self.axis_groups, norm_type, _AXIS_COMBOS, uncounted)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

        def closure_then_reduce() -> Any:
            result = closure()
            self._after_backward(raw)
            return result

        result = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        flat = self._flat_zero(raw)
        if flat is not None:
            flat.discard_unstepped()  # fp16 skipped the update: forget the reduced gradients on every rank
        return result

    # ----- steps -----

    def _step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None and self.model is not None
        with context:
            if self._route_steps_through_root:
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

    # ----- collectives -----

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the dp axis by default: pipeline stages and tensor shards hold the same values."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._mesh is not None:
            group = self.device_mesh[DP].get_group()
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank votes (Lightning counts the votes against the world size; ``reduce`` sums over dp only)."""
        if not _distributed_is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    # ----- checkpoints: sharded folders (default) or one gathered file in the single-process format -----

    def _flat_zeros(self) -> list[FlatZero | None]:
        return [self._flat_zero(o) for o in self.optimizers]

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's state in the single-process format, on rank 0 (collective)."""
        assert self.model is not None
        return full_model_state_dict(self.model)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        if self.checkpoint_format == "sharded":
            return self.model.state_dict()  # the shards as they are: save_checkpoint writes them in place
        return self.full_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.checkpoint_format == "sharded":
            return {}  # save_checkpoint takes each rank's states from the optimizers themselves
        flat = self._flat_zero(optimizer)
        if flat is not None:
            return flat.full_state_dict()
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return full_optimizer_state_dict(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.checkpoint_format == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "checkpoint_format='sharded' writes with torch's distributed checkpoint: no storage_options."
            )
        checkpointing.save(self, checkpoint, filepath, self._flat_zeros(), self._full_param_order)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if checkpoint_io.is_sharded_checkpoint(checkpoint_path):
            return checkpointing.load(self, checkpoint_path, self._flat_zeros())
        if Path(checkpoint_path).is_dir():
            raise FileNotFoundError(
                f"ckpt_path={str(checkpoint_path)!r} is a folder but not a sharded checkpoint (no .metadata and "
                "meta.pt in it): give the folder a save wrote, or a checkpoint file."
            )
        return checkpoint_io.load_file(checkpoint_path)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.model is not None
        if checkpoint.get(checkpointing.LOADED_IN_PLACE):
            return
        load_full_model_state_dict(self.model, dict(checkpoint["state_dict"]), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.model is not None
        if checkpoint.get(checkpointing.LOADED_IN_PLACE):
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            flat = self._flat_zero(optimizer)
            if flat is not None:
                flat.load_full_state_dict(state)
            else:
                load_full_optimizer_state_dict(self.model, optimizer, state)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        hidden = self.__dict__.pop("_hidden_example_input", None)
        if hidden is not None and self.lightning_module is not None:
            self.lightning_module.example_input_array = hidden
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
