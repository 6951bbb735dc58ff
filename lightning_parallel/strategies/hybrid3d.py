"""hybrid3d: data x pipeline x tensor parallelism on one (pp, dp, tp) mesh, with ZeRO over dp."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.mesh import DP, PP, TP, ParallelDims
from lightning_parallel.parallel.activation_checkpoint import check_activation_checkpointing
from lightning_parallel.parallel.fsdp import apply_fsdp
from lightning_parallel.parallel.layer_profile import (
    example_microbatch,
    in_flight_microbatches,
    layer_state_bytes,
    profile_layers,
    profiled_partition,
)
from lightning_parallel.parallel.partition import balanced_partition, check_stage_count, uniform_partition
from lightning_parallel.parallel.pipeline import (
    SCHEDULES,
    Pipeline,
    PipelineSplit,
    TiedGradients,
    check_microbatches,
    layer_paths,
    split_model,
    stage_ranks_for,
    stages_per_rank,
)
from lightning_parallel.parallel.pipeline_state import gather_pipeline_optimizer_state, pipeline_local_optimizer_state
from lightning_parallel.parallel.state_dict import full_model_state_dict, load_full_model_state_dict
from lightning_parallel.parallel.tensor import apply_tp, check_tp_plan, resolvable_plan
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.checkpointing import LOADED_IN_PLACE
from lightning_parallel.strategies.hybrid3d_checks import (
    as_built,
    check_degree_arg,
    check_memory_budget,
    check_resettable,
    check_virtual_stages,
)
from lightning_parallel.strategies.pipelined_step import PipelinedStep
from lightning_parallel.strategies.precision import loss_scale_of
from lightning_parallel.strategies.zero import check_flag, check_zero_settings

PIPELINE_SCHEDULES = SCHEDULES
PIPELINE_BALANCES = ("uniform", "params", "profile")


class Hybrid3DStrategy(MeshStrategy):
    """Train one LightningModule across any split of the world into (pp, dp, tp).

    Pipeline parallelism cuts the module's ``pipeline_layers()`` into contiguous stages on the pp axis
    and runs them under a ``torch.distributed.pipelining`` schedule; tensor parallelism applies the
    module's ``tensor_parallel_plan()`` (Megatron column/row splits) on the tp axis; data parallelism
    averages gradients over dp, or shards model states there with ``zero_stage`` 1-3 (also together with
    pp). The logged loss is the same on every rank; samplers and ``sync_dist`` use the dp axis.

    Args:
        dp: data-parallel degree; ``"auto"`` takes the ranks pp and tp leave.
        pp: pipeline-parallel degree (stages).
        tp: tensor-parallel degree.
        zero_stage: 0 (gradients averaged over dp), 1, 2 or 3 (ZeRO over dp).
        pp_schedule: one of ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble``.
        microbatches: microbatches per pipeline step (default: 2 * pp); they must divide each dp rank's batch.
        pp_balance: ``uniform`` (layers per stage), ``params`` (parameter count per stage) or ``profile``
            (forward+backward time per stage, each layer timed on the module's ``example_input_array``, one
            microbatch, before the split).
        pp_memory_budget: with ``pp_balance="profile"``, the most bytes one stage may hold: its layers'
            parameters, gradients and two optimizer states (as ZeRO and tp shard them) plus the activations
            its in-flight microbatches keep for backward, measured while profiling. None: no limit.
        pp_virtual_stages: stages per rank for ``interleaved_1f1b`` (default 2); ``zero_bubble`` runs 2
            (ZB-V), ``gpipe`` and ``1f1b`` 1.
        sequence_parallel: also split layer norms and the residual stream along the sequence over tp.
        activation_checkpointing: ``"none"``, ``"full"`` (recompute each pipeline layer in backward, keep only
            its input) or ``"selective"`` (keep matmul, conv and attention outputs, recompute the rest).
        offload: keep ZeRO-2/3 states on the host.
        **kwargs: passed to :class:`~lightning_parallel.strategies.base.MeshStrategy`.
    """

    strategy_name = "hybrid3d"

    def __init__(
        self,
        dp: int | Literal["auto"] = "auto",
        pp: int = 1,
        tp: int = 1,
        zero_stage: int = 0,
        pp_schedule: str = "1f1b",
        microbatches: int | None = None,
        pp_balance: str = "uniform",
        pp_memory_budget: int | None = None,
        pp_virtual_stages: int | None = None,
        sequence_parallel: bool = False,
        activation_checkpointing: str = "none",
        offload: bool = False,
        reshard_after_forward: bool = True,
        **kwargs: Any,
    ) -> None:
        check_degree_arg("dp", dp, allow_auto=True)
        check_degree_arg("pp", pp)
        check_degree_arg("tp", tp)
        check_zero_settings(zero_stage, offload, stages=(0, 1, 2, 3), name="zero_stage")
        check_flag("sequence_parallel", sequence_parallel)
        check_flag("reshard_after_forward", reshard_after_forward)
        if sequence_parallel and tp == 1:
            rank_zero_warn(
                "sequence_parallel=True splits along the sequence over tp, and tp=1: ignored. "
                "Set tp > 1 to use it, or sequence_parallel=False."
            )
        if pp_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"pp_schedule={pp_schedule!r} is unknown: set it to one of {', '.join(PIPELINE_SCHEDULES)}."
            )
        if pp_balance not in PIPELINE_BALANCES:
            raise ValueError(f"pp_balance={pp_balance!r} is unknown: set it to one of {', '.join(PIPELINE_BALANCES)}.")
        if microbatches is not None:
            check_degree_arg("microbatches", microbatches)
        check_memory_budget(pp_balance, pp_memory_budget)
        check_virtual_stages(pp_schedule, pp_virtual_stages)
        pipeline_set = pp_schedule != "1f1b" or microbatches is not None or pp_balance != "uniform"
        if pp == 1 and (pipeline_set or pp_virtual_stages is not None):
            rank_zero_warn(
                "pp_schedule, microbatches, pp_balance and pp_virtual_stages only apply with pp > 1: ignored at pp=1."
            )
        if pp > 1:
            microbatches = 2 * pp if microbatches is None else microbatches
            setting = f"strategy='hybrid3d' (pp={pp}, pp_schedule={pp_schedule!r})"
            check_microbatches(pp_schedule, microbatches, pp, setting)
        activation_checkpointing = check_activation_checkpointing(activation_checkpointing)
        if pp > 1 and pp_schedule == "zero_bubble" and activation_checkpointing == "selective":
            raise ValueError(
                "activation_checkpointing='selective' cannot run under pp_schedule='zero_bubble': its split backward "
                "recomputes each layer twice (input, then weight gradients) and selective checkpointing keeps what "
                "it saved for one backward only. Use activation_checkpointing='full' or another pp_schedule."
            )
        if pp > 1 and pp_schedule == "zero_bubble" and zero_stage == 3 and reshard_after_forward:
            # resharding between a zero-bubble schedule's split backward passes gives wrong weight gradients
            rank_zero_warn("pp_schedule='zero_bubble' with zero_stage=3 keeps parameters gathered after forward.")
            reshard_after_forward = False
        if zero_stage != 3 and not reshard_after_forward:
            rank_zero_warn("reshard_after_forward only applies with zero_stage=3: ignored.")
        super().__init__(
            zero_stage=zero_stage,
            offload=offload,
            reshard_after_forward=reshard_after_forward,
            activation_checkpointing=activation_checkpointing,
            **kwargs,
        )
        self._degrees = {"dp": dp, "pp": pp, "tp": tp}
        self.pp_schedule = pp_schedule
        self.microbatches = microbatches
        self.pp_balance = pp_balance
        self.pp_memory_budget = pp_memory_budget
        self.pp_virtual_stages = stages_per_rank(pp_schedule, pp_virtual_stages)
        self.sequence_parallel = sequence_parallel
        self._split: PipelineSplit | None = None
        self._pipelined: PipelinedStep | None = None
        self._tied: TiedGradients | None = None

    @override
    def _setting(self) -> str:
        d = self._degrees
        return f"strategy='hybrid3d' (dp={d['dp']!r}, pp={d['pp']}, tp={d['tp']}, zero_stage={self.zero_stage})"

    @override
    def _parallel_degrees(self, world_size: int) -> ParallelDims:
        return ParallelDims.from_degrees(world_size, **self._degrees)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        self.check_model(model)  # again here: under torchrun no launcher ran it
        super().connect(model)

    @override
    def check_model(self, model: pl.LightningModule) -> None:
        dims = self.parallel_dims
        # what configure_model makes, on meta; None when that cannot be known here
        built = as_built(model) if dims.pp > 1 or dims.tp > 1 else model
        if dims.tp > 1:
            if not callable(getattr(model, "tensor_parallel_plan", None)):
                raise TypeError(
                    f"tp={dims.tp} needs {type(model).__name__}.tensor_parallel_plan(sequence_parallel) returning "
                    "{module path: ParallelStyle}: add it (see the README's bring-your-own-model section) or set tp=1."
                )
            plan = model.tensor_parallel_plan(self.sequence_parallel)
            check_tp_plan(model if built is None else built, plan, dims.tp, require_match=built is not None)
        if dims.pp > 1:
            missing = [m for m in ("pipeline_layers", "loss") if not callable(getattr(model, m, None))]
            if missing:
                raise TypeError(
                    f"pp={dims.pp} needs {type(model).__name__}.{' and .'.join(missing)}(): pipeline_layers() returns "
                    "the layers forward runs in order, loss(output, target) the loss. Add them (see the README's "
                    "bring-your-own-model section) or set pp=1."
                )
            if self.pp_balance == "profile":
                example_microbatch(model)  # a missing example fails before launch; it is timed after
            try:
                # more stages than layers fails here
                self._pipeline_partition(model if built is None else built, measure=False)
            except AttributeError:
                if not is_overridden("configure_model", model):
                    raise
                # layers built in configure_model do not exist yet: checked when the model is split
            if built is not None and built is not model:  # built on meta: each layer must initialize itself
                for layer in built.pipeline_layers():
                    check_resettable(layer)
        check = getattr(model, "check_parallel_degrees", None)
        if callable(check):
            check(pp=dims.pp, tp=dims.tp)

    def _pipeline_partition(self, model: pl.LightningModule, measure: bool = True) -> list[range]:
        """The layers of each stage; ``measure=False`` (before launch) only checks the stage count."""
        layers = list(model.pipeline_layers())
        num_stages = self.parallel_dims.pp * self.pp_virtual_stages
        setting = (
            f"strategy='hybrid3d' with pp={self.parallel_dims.pp} and pp_schedule={self.pp_schedule!r} "
            f"({self.pp_virtual_stages} stage(s) per rank)"
        )
        check_stage_count(len(layers), num_stages, setting)
        if self.pp_balance == "params":
            costs = [sum(p.numel() for p in layer.parameters()) for layer in layers]
            return balanced_partition(costs, num_stages)
        if self.pp_balance == "profile" and measure:
            return self._profiled_partition(model, layers, num_stages)
        return uniform_partition(len(layers), num_stages)

    def _profiled_partition(self, model: pl.LightningModule, layers: list[torch.nn.Module], stages: int) -> list[range]:
        dims = self.parallel_dims
        # every rank times; the maximum over the world makes every rank choose the same split
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        profile = profile_layers(layers, example_microbatch(model), self.root_device, group=group)
        assert self.microbatches is not None
        split = profiled_partition(
            profile,
            stages,
            budget=self.pp_memory_budget,
            in_flight=in_flight_microbatches(self.pp_schedule, self.microbatches, stages, dims.pp),
            state_bytes=[layer_state_bytes(b, self.zero_stage, dims.dp, dims.tp) for b in profile.param_bytes],
            setting="pp_memory_budget",
        )
        rank_zero_info(f"pp_balance='profile': {split.describe()}")
        return split.stages

    @override
    def _apply_model_parallel(self) -> None:
        module = self.lightning_module
        assert module is not None and self.model is not None
        dims = self.parallel_dims
        if dims.pp > 1:
            paths = layer_paths(self.model, module.pipeline_layers())
            partition = self._pipeline_partition(module)
            ranks = stage_ranks_for(self.pp_schedule, len(partition), dims.pp)
            pp_rank = self.device_mesh[PP].get_local_rank()
            self._split = split_model(self.model, paths, partition, ranks, pp_rank)
            self._materialize_stages()
        if dims.tp > 1:
            plan = module.tensor_parallel_plan(self.sequence_parallel)
            if dims.pp > 1:  # entries for layers other stages hold resolve to nothing here
                plan = resolvable_plan(self.model, plan)
            apply_tp(self.model, self.device_mesh[TP], plan)
            if callable(getattr(module, "loss", None)) and dims.pp == 1:  # under pp the pipeline wraps it
                module.loss = _vocab_parallel(module.loss)

    @override
    def _sync_batchnorm_over_dp(self) -> None:
        if self._layer_sync is not None and self.parallel_dims.pp > 1 and self.microbatches != 1:
            rank_zero_warn(
                f"sync_batchnorm with pp={self.parallel_dims.pp} and microbatches={self.microbatches}: BatchNorm "
                "statistics cover one microbatch of every dp rank, not the whole batch. Set microbatches=1 for "
                "the whole batch's statistics (the pipeline then runs its stages one after another)."
            )
        super()._sync_batchnorm_over_dp()

    @override
    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # under pp, configure_model builds on the meta device: each rank materializes only its stages
        if self.parallel_dims.pp == 1:
            yield
            return
        with torch.device("meta"):
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if any(t.is_meta for t in (*self.model.parameters(), *self.model.buffers())):
            return  # built on meta: each stage is materialized on the device once the model is split
        super().model_to_device()

    def _materialize_stages(self) -> None:
        """Give this rank's stages real storage and initial values when they were built on meta."""
        assert self._split is not None
        for stage in self._split.stages.values():
            tensors = [*stage.parameters(), *stage.buffers()]
            if not any(t.is_meta for t in tensors):
                continue
            stage.to_empty(device=self.root_device)
            for layer in stage.layers:
                check_resettable(layer)
                layer.reset_parameters()

    @override
    def _parallelize_model(self) -> None:
        if self.parallel_dims.pp == 1:
            return super()._parallelize_model()
        module = self.lightning_module
        assert module is not None and self._split is None
        self._apply_model_parallel()
        split = self._split
        assert split is not None
        # after the split and tp, before ZeRO-3 wraps each layer: only this rank's layers
        self._apply_activation_checkpointing([layer for stage in split.stages.values() for layer in stage.layers])
        if self.zero_stage == 3:
            self.fsdp_units = []
            for index, stage in sorted(split.stages.items()):
                # each layer is a unit; the stage is the root torch's schedules drive
                units = [f"layers.{i}" for i in range(len(stage.layers))] + [""]
                apply_fsdp(
                    stage,
                    self.device_mesh[DP],
                    reshard_after_forward=self.reshard_after_forward,
                    offload=self.offload,
                    units=units,
                )
                self.fsdp_units += [f"stage{index}.{u}" if u else f"stage{index}" for u in units]
        pp_group = self.device_mesh[PP].get_group()
        tp = self.parallel_dims.tp > 1
        # under tp the whole schedule runs in one loss_parallel context: its backward needs the rules too,
        # and a nested context would switch them off on exit
        loss_fn = _full_tensor(module.loss) if tp else module.loss
        pipeline = Pipeline(split, self.pp_schedule, self.microbatches, pp_group, self.root_device, loss_fn)
        params = list(dict.fromkeys(p for stage in split.stages.values() for p in stage.parameters()))
        context = loss_parallel if tp else contextlib.nullcontext
        # fp16: the schedule backpropagates the loss times the current scale (the plugin's pre_backward cannot)
        self._pipelined = PipelinedStep(module, pipeline, params, context, lambda: loss_scale_of(self.precision_plugin))
        self._tied = TiedGradients(self.model, split.tie_groups, pp_group) if split.tie_groups else None

    @override
    def _after_backward(self, optimizer: Optimizer) -> None:
        if self._tied is not None:
            self._tied.reduce()  # before the dp reduction: both are sums
        super()._after_backward(optimizer)

    @override
    def _excluded_from_norm(self) -> set[int]:
        return self._tied.excluded_from_norm() if self._tied is not None else set()

    @override
    def _stage_axes(self) -> tuple[str, ...]:
        return (PP,) if self.parallel_dims.pp > 1 else ()

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
        if self.parallel_dims.tp == 1:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with loss_parallel():  # the vocabulary-parallel loss needs its own backward rules too
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ----- full-file checkpoints: every stage contributes its layers, in the single-process format -----
    # (sharded folders need nothing here: each stage writes its own tensors under their unsplit names)

    def _full_format_under_pp(self) -> bool:
        return self._split is not None and self.checkpoint_format == "full"

    @override
    def full_state_dict(self) -> dict[str, Any]:
        if self._split is None:
            return super().full_state_dict()
        assert self.model is not None
        state = full_model_state_dict(self.model, every_rank=True)
        everyone: list[Any] = [None] * self.parallel_dims.pp
        dist.all_gather_object(everyone, state, group=self.device_mesh[PP].get_group())
        merged: dict[str, Any] = {}
        for part in everyone:
            for key, value in part.items():
                merged.setdefault(key, value)
        return merged

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._split is None or checkpoint.get(LOADED_IN_PLACE):
            return super().load_model_state_dict(checkpoint, strict)
        assert self.model is not None
        mine = set(self.model.state_dict())
        state = {k: v for k, v in checkpoint["state_dict"].items() if k in mine}
        load_full_model_state_dict(self.model, state, strict=strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        local = super().optimizer_state(optimizer)
        if not self._full_format_under_pp():
            return local
        assert self.model is not None
        return gather_pipeline_optimizer_state(
            local, self._local_param_names(optimizer), self._split, self.device_mesh[PP].get_group()
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._split is None or checkpoint.get(LOADED_IN_PLACE):
            return super().load_optimizer_state_dict(checkpoint)
        states = []
        for optimizer, full in zip(self.optimizers, checkpoint["optimizer_states"]):
            names = self._local_param_names(optimizer)
            states.append(pipeline_local_optimizer_state(full, names, self._split, self.device_mesh[PP].get_group()))
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

    def _local_param_names(self, optimizer: Optimizer) -> list[list[str]]:
        """The parameter names of each of ``optimizer``'s groups, as configure_optimizers built them."""
        assert self.model is not None
        names: dict[int, str] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        flat = self._flat_zero(optimizer)
        raw = getattr(optimizer, "_optimizer", optimizer)
        groups = flat.original_params if flat is not None else [g["params"] for g in raw.param_groups]
        return [[names[id(p)] for p in group] for group in groups]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("hybrid3d", cls, description="data x pipeline x tensor parallelism", override=True)


def _full_tensor(loss_fn: Any) -> Any:
    """The module's loss as a plain tensor when it comes out of a vocabulary-parallel computation."""

    def loss(*args: Any, **kwargs: Any) -> Tensor:
        value = loss_fn(*args, **kwargs)
        return value.full_tensor() if isinstance(value, DTensor) else value

    return loss


def _vocab_parallel(loss_fn: Any) -> Any:
    """Run the module's loss so it accepts logits left sharded over the vocabulary by the head."""

    def loss(*args: Any, **kwargs: Any) -> Tensor:
        with loss_parallel():
            value = loss_fn(*args, **kwargs)
        return value.full_tensor() if isinstance(value, DTensor) else value

    return loss
