"""Applying the parallelisms to a model: the one place their order lives. Pure torch.

    1. pipeline split (pp)      this rank keeps its stages' layers (materialized here when built on meta and
                                nothing else shards them)
       placement                the rest of the order runs on the meta device where tp or ZeRO-3 shard parameters
                                (host-built values set aside, ``materialize.py``); else this rank's tensors move to
                                the device
    2. expert parallel (ep)     each MoE layer keeps E/ep experts, tokens travel by all-to-all
    3. tensor parallel (tp)     the module's plan, on what this rank holds (experts replicated over tp)
    4. context parallel (cp)    attention cores and position ids switched to the cp group's (ring or Ulysses);
                                the strategy splits each batch along the sequence
       or spatial (on cp)       convolutions borrow halo rows, BatchNorms reduce over the strips, the classifier's
                                input is gathered; the strategy splits each batch's images by height
    5. activation checkpointing this rank's layers, after tp (torchtitan's order), before sharding wraps them;
                                with ``compile`` each layer's forward is ``torch.compile``d first (checkpointing then
                                recomputes the compiled forward)
    6. data-parallel sharding   ZeRO-3 wraps units (each layer, and each stage under pp; experts over the ranks
                                holding the same experts); stages 0-2 shard the optimizers later, when
                                ``configure_optimizers`` has built them
    7. materialization          tensors still on meta get storage and values, each rank only what it holds: the
                                module's ``materialize(device)`` (a module that loads its own weights), the values
                                set aside, else each unit's ``reset_parameters()`` (``materialize.py``)

Each step reads the module through :mod:`lightning_parallel.protocol` and its settings from
:class:`~lightning_parallel.parallel.config.ParallelConfig`; the meshes come from the roles of
:class:`~lightning_parallel.parallel.mesh.ParallelMesh`. An axis added later (experts, context) gets its step
here, in its place in the order.

May import: anything under ``lightning_parallel.parallel`` and ``lightning_parallel.protocol``. Never Lightning.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel._compat import is_in_torch_dispatch_mode
from lightning_parallel.parallel.activation_checkpoint import apply_activation_checkpointing, checkpoint_layers
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.context.apply import ContextParallel, apply_context_parallel
from lightning_parallel.parallel.data.sharding import DataParallelSharding
from lightning_parallel.parallel.data.stages import stage_sharding as sharding_of
from lightning_parallel.parallel.expert.apply import apply_expert_parallel, require_moe_layers
from lightning_parallel.parallel.expert.moe import MoE
from lightning_parallel.parallel.materialize import fill_meta_tensors, move_real, set_aside, splits_parameters
from lightning_parallel.parallel.mesh import ParallelMesh
from lightning_parallel.parallel.pipeline.partition import balanced_partition, check_stage_count, uniform_partition
from lightning_parallel.parallel.pipeline.profile import example_microbatch, profile_layers, profiled_partition
from lightning_parallel.parallel.pipeline.split import (
    ElsewhereLayer,
    PipelineSplit,
    layer_paths,
    materialize_stages,
    split_model,
)
from lightning_parallel.parallel.pipeline.tied import TiedGradients
from lightning_parallel.parallel.spatial.apply import SpatialParallel, apply_spatial_parallel
from lightning_parallel.parallel.tensor.plan import apply_tp, resolvable_plan
from lightning_parallel.protocol import (
    expert_parallel_plan,
    materialize,
    materializes_itself,
    pipeline_layers,
    require_materialized,
    spatial_gather_modules,
    tensor_parallel_plan,
)

Warn = Callable[[str], Any]


@dataclass
class Parallelized:
    """What :func:`parallelize` did to the model on this rank."""

    split: PipelineSplit | None = None  # this rank's pipeline stages (pp > 1)
    tied: TiedGradients | None = None  # weights tied across stages (pp > 1)
    fsdp_units: list[str] = field(default_factory=list)  # ZeRO-3 units ("" the root itself)
    moe_layers: list[str] = field(default_factory=list)  # MoE layers whose experts are split over ep
    checkpointed: list[nn.Module] = field(default_factory=list)  # layers recomputed in backward
    compiled: list[nn.Module] = field(default_factory=list)  # layers run through torch.compile
    context: ContextParallel | None = None  # cp > 1: this rank's attention, positions and batch split
    context_attention: list[str] = field(default_factory=list)  # attention modules switched to it
    spatial: SpatialParallel | None = None  # spatial > 1: this rank's strips, and the modules switched to them
    # run by parallel/step.py after the data-parallel reduction, in order, on this rank's gradient pieces (in
    # place): where an axis that changes the gradients once they are reduced (averaging over copies of the layout,
    # say) hooks in from its step here, without touching the step itself
    grad_hooks: list[Callable[[list[torch.Tensor]], None]] = field(default_factory=list)

    def shard_batch(self, batch: Any) -> Any:
        """This rank's piece of every sample in ``batch``: its sequence chunks (cp), its image strips (spatial)."""
        if self.context is not None:
            batch = self.context.shard_batch(batch)
        return self.spatial.shard_batch(batch) if self.spatial is not None else batch

    @property
    def splits_samples(self) -> bool:
        return self.context is not None or self.spatial is not None

    @property
    def route_through_root(self) -> bool:
        """True when the root itself is a ZeRO-3 unit: its forward hooks must run every step."""
        return "" in self.fsdp_units


def parallelize(
    root: nn.Module,
    module: Any,
    mesh: ParallelMesh,
    config: ParallelConfig,
    sharding: DataParallelSharding,
    device: torch.device,
    *,
    warn: Warn = warnings.warn,
    info: Warn = print,
    rng_state: torch.Tensor | None = None,
) -> Parallelized:
    """Split ``root`` in place over ``mesh`` as ``config`` says, in the fixed order of this module's docstring.

    Args:
        root: the model to split (the LightningModule itself, or what wraps it).
        module: the object with the protocol methods (usually ``root``).
        mesh: the world's mesh.
        config: a validated config.
        sharding: the data-parallel sharding of ``config.zero_stage`` over ``mesh["shard"]``.
        device: this rank's device: where its pieces are materialized (``root`` may be on the host, or on meta).
        warn: where to report a setting that found nothing to apply to; info: where to say what was chosen.
        rng_state: the CPU generator's state when ``root`` was built on the meta device (reset_parameters()
            replays its draws from there).
    """
    done = Parallelized()
    dims = mesh.dims
    on_meta = splits_parameters(config)  # tp or ZeRO-3: nothing is whole on any rank, ever
    if dims.pp > 1:
        done.split = apply_pipeline_split(root, module, mesh, config, device, sharding.stage, info, not on_meta)
    values = set_aside(root) if on_meta else {}  # host-built values, copied slice by slice in step 7
    if not on_meta:
        move_real(root, device)  # pp alone: this rank's stages (the other stages' host tensors are dropped)
    if dims.ep > 1:
        done.moe_layers = apply_expert_parallel(root, mesh["expert"], expert_parallel_plan(module))
        require_moe_layers(len(done.moe_layers), dims.ep, type(module).__name__)
    if dims.tp > 1:
        plan = tensor_parallel_plan(module, dims.tp, config.sequence_parallel)
        if done.split is not None:  # entries for layers other stages hold resolve to nothing here
            plan = resolvable_plan(root, plan, placeholders=(ElsewhereLayer,))
        apply_tp(root, mesh["tensor"], plan)
    if dims.context > 1:
        done.context, done.context_attention = apply_context_parallel(module, mesh["context"], config.cp_mode)
    if dims.spatial > 1:  # before ZeRO-3 wraps the layers; BatchNorms synced over dp then reduce over dp x spatial
        gather = spatial_gather_modules(module, dims.spatial)
        example = getattr(module, "example_input_array", None)
        done.spatial = apply_spatial_parallel(
            root, mesh.group("context"), gather, synced_group=mesh.group("loss"), example=example
        )
    _compile_and_checkpoint(done, module, config, warn)
    if done.split is None:
        done.fsdp_units = sharding.shard_module(root)
    else:
        for index, stage in sorted(done.split.stages.items()):
            # each layer is a unit; the stage is the root torch's schedules drive
            made = sharding.shard_module(stage, [f"layers.{i}" for i in range(len(stage.layers))] + [""])
            done.fsdp_units += [f"stage{index}.{u}" if u else f"stage{index}" for u in made]
    apply_materialization(root, module, sharding, device, values, rng_state)
    if done.split is not None:
        done.tied = TiedGradients(root, done.split.tie_groups, mesh.group("stage")) if done.split.tie_groups else None
    return done


def _compile_and_checkpoint(done: Parallelized, module: Any, config: ParallelConfig, warn: Warn) -> None:
    """Step 5: this rank's layers compiled (``compile``), then recomputed in backward (activation checkpointing)."""
    layers = done.split.layers() if done.split is not None else module
    if config.compile:  # before activation checkpointing, which then recomputes the compiled forward
        done.compiled = compile_layers(layers)
        if not done.compiled:
            warn(
                f"compile=True found no layers in {type(module).__name__}: give it pipeline_layers() or keep its "
                "repeated blocks in an nn.ModuleList; nothing is compiled."
            )
    done.checkpointed = apply_activation_checkpointing(layers, config.activation_checkpointing)
    if config.activation_checkpointing != "none" and not done.checkpointed:
        warn(
            f"activation_checkpointing={config.activation_checkpointing!r} found no layers in "
            f"{type(module).__name__}: give it pipeline_layers() (see docs/custom-models.md) or keep its "
            "repeated blocks in an nn.ModuleList; nothing is recomputed."
        )


def apply_materialization(
    root: nn.Module,
    module: Any,
    sharding: DataParallelSharding,
    device: torch.device,
    values: dict[str, torch.Tensor],
    rng_state: torch.Tensor | None,
) -> None:
    """Step 7: storage and values for what is still on meta, each rank only its pieces: the module's own
    ``materialize(device)`` first (HFCausalLM reads its slices of a folder), then the host values set aside, then each
    unit's ``reset_parameters()`` (``materialize.py``); a TypeError naming anything left."""
    materialize(module, root, device)
    # ZeRO-3 offload keeps the parameter shards on the host
    params_device = torch.device("cpu") if sharding.offload and "params" in sharding.sharded else device
    fill_meta_tensors(module, root, device, values, params_device=params_device, rng_state=rng_state)
    require_materialized(module, root)


def compile_layers(layers: Any) -> list[nn.Module]:
    """``torch.compile`` each layer's forward in place (names and state_dict keys unchanged; the module's hooks, such
    as FSDP2's, stay outside the compiled region): the pipeline layers of this rank, else the module's repeated
    blocks, as activation checkpointing picks them. Layers of the same code share their compiled graphs."""
    chosen = checkpoint_layers(layers)
    for layer in chosen:
        forward = layer.__dict__.get("forward") or type(layer).forward.__get__(layer)
        moes = [m for m in layer.modules() if isinstance(m, MoE)]  # their figures recorded after the compiled call
        layer.forward = _compiled_outside_dispatch_modes(forward, moes)
    return chosen


def _compiled_outside_dispatch_modes(forward: Any, moes: list[Any] = ()) -> Any:
    """``torch.compile(forward)``, run eagerly while a (non-infra) dispatch mode is active.

    torch.compile does not trace under such a mode (FLOP and byte counters, Lightning's model summary, which runs
    ``example_input_array`` under its FLOP counter at fit start), and a function whose first call meets one is
    marked as skipped and never compiled afterwards: the whole fit would run eagerly. So those calls go to the
    eager forward, and the compiled one first runs, and compiles, outside them. The MoE layers in ``moes`` leave
    their routing figures to be recorded here, eagerly (:meth:`MoE.flush_stats`): no graph break for them."""
    compiled = torch.compile(forward)

    @functools.wraps(forward)
    def forward_(*args: Any, **kwargs: Any) -> Any:
        if is_in_torch_dispatch_mode(include_infra_modes=False):
            return forward(*args, **kwargs)
        out = compiled(*args, **kwargs)
        for moe in moes:
            moe.flush_stats()
        return out

    return forward_


def apply_pipeline_split(
    root: nn.Module,
    module: Any,
    mesh: ParallelMesh,
    config: ParallelConfig,
    device: torch.device,
    zero_stage: int,
    info: Warn = print,
    materialize_now: bool = True,
) -> PipelineSplit:
    """Step 1: keep this rank's stages of ``module.pipeline_layers()`` in ``root``; materialize them if on meta
    (unless ``materialize_now`` is False: tp or ZeRO-3 shard them first, step 7 fills the shards)."""
    layers = pipeline_layers(module, mesh.dims.pp)
    paths = layer_paths(root, layers)
    dims = mesh.dims
    partition = stage_partition(layers, module, config, dims.pp, dims.dp, dims.tp, zero_stage, device, info=info)
    ranks = config.schedule.stage_ranks(len(partition), mesh.dims.pp)
    split = split_model(root, paths, partition, ranks, mesh.rank("stage"))
    if materialize_now and not materializes_itself(module):  # else step 7, once tp and ZeRO-3 made the shards
        materialize_stages(split, device)
    return split


def stage_partition(
    layers: list[nn.Module],
    module: Any,
    config: ParallelConfig,
    pp: int,
    dp: int = 1,
    tp: int = 1,
    zero_stage: int = 0,
    device: torch.device | None = None,
    *,
    measure: bool = True,
    info: Warn = print,
) -> list[range]:
    """The layers of each stage, by ``config.pp_balance``; ``measure=False`` (before launch) checks the stage
    count and does not time anything."""
    num_stages = pp * config.stages_per_rank
    setting = (
        f"strategy='hybrid3d' with pp={pp} and pp_schedule={config.pp_schedule!r} "
        f"({config.stages_per_rank} stage(s) per rank)"
    )
    check_stage_count(len(layers), num_stages, setting)
    if config.pp_balance == "params":
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        return balanced_partition(sizes, num_stages, stage_ranks=config.schedule.stage_ranks(num_stages, pp))
    if config.pp_balance == "profile" and measure:
        stages, described = _profiled(layers, module, config, pp, dp, tp, zero_stage, device or torch.device("cpu"))
        info(f"pp_balance='profile': {described}")
        return stages
    return uniform_partition(len(layers), num_stages)


def _profiled(
    layers: list[nn.Module],
    module: Any,
    config: ParallelConfig,
    pp: int,
    dp: int,
    tp: int,
    zero_stage: int,
    device: torch.device,
) -> tuple[list[range], str]:
    num_stages = pp * config.stages_per_rank
    # every rank times; the maximum over the world makes every rank choose the same split
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    profile = profile_layers(layers, example_microbatch(module), device, group=group)
    assert config.microbatches is not None, "a validated config under pp has its microbatches"
    ranks = config.schedule.stage_ranks(num_stages, pp)
    in_flight = [config.schedule.in_flight(pp, config.microbatches, r, config.stages_per_rank) for r in ranks]
    sharding = sharding_of(zero_stage)
    split = profiled_partition(
        profile,
        num_stages,
        budget=config.pp_memory_budget,
        in_flight=in_flight,
        state_bytes=[sharding.state_bytes(b, dp) / tp for b in profile.param_bytes],
        setting="pp_memory_budget",
        stage_ranks=ranks,
    )
    return split.stages, split.describe()
