"""Every (pp, dp, tp, ep, zero_stage) split of a world size, estimated from a model's measured layers. Pure torch.

:func:`layer_costs` measures each pipeline layer as one tp rank runs it: the layer is copied from the meta
device with the tensors the tp plan splits cut to their local shard (Colwise/ChannelOut: output features;
Rowwise/ChannelIn: input features; the vocabulary of a Rowwise embedding; ChannelNorm: channels), given real
storage on the host, and run forward at micro-batch sizes 1 and 2 under
:class:`~lightning_parallel.parallel.measure.memory.ActivationMemory` (the bytes left for backward) and torch's
``FlopCounterMode``. Activations are linear in the batch, so the two sizes give the bytes of any microbatch.
:func:`plan_layouts` turns those records into one :class:`~lightning_parallel.planning.estimate.Estimate` per
layout, with the real stage partition (:func:`~lightning_parallel.parallel.pipeline.partition.uniform_partition`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.stages import planned_stages
from lightning_parallel.parallel.expert.moe import GroupedExperts, MoE
from lightning_parallel.parallel.measure.memory import ActivationMemory
from lightning_parallel.parallel.pipeline.partition import uniform_partition
from lightning_parallel.parallel.tensor.conv import ChannelInParallel, ChannelNormParallel, ChannelOutParallel
from lightning_parallel.planning.adapters import lora_params
from lightning_parallel.planning.estimate import Estimate, LayerCost, Settings, check_precision, estimate_layout

# the norms whose inputs sequence parallelism splits over tp (with the residual stream they read)
NORMS = (nn.LayerNorm, nn.RMSNorm)


@dataclass
class ModelSpec:
    """What the planner needs of a model.

    Attributes:
        model: the whole model, built on the meta device (nothing is allocated).
        layers: its pipeline layers in forward order (each a submodule of ``model``).
        plan: its tensor-parallel plan, module paths relative to ``model``.
        make_input: micro-batch size -> the first layer's input, on the host.
        loss: (output, batch) -> the training loss, as the LightningModule computes it.
        check_tp: raises ValueError when the model cannot split over that tp.
        optimizer_states: optimizer-state tensors per parameter (2 for Adam, 1 for SGD with momentum).
        num_experts: experts of each MoE layer (0: a dense model); ep runs over the divisors of dp that divide it.
        lora_rank: LoRA adapters of that rank on a frozen base (0: every parameter trains).
        lora_targets: with ``lora_rank``, a regex on module paths: the linear layers the adapters go on.
    """

    model: nn.Module
    layers: list[nn.Module]
    plan: Mapping[str, ParallelStyle]
    make_input: Callable[[int], Tensor]
    loss: Callable[[Tensor, int], Tensor]
    check_tp: Callable[[int], None]
    optimizer_states: int = 2
    num_experts: int = 0
    lora_rank: int = 0
    lora_targets: str = ""


def _matches(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) and path.count(".") == pattern.count(".")


def split_dims(style: ParallelStyle, module: nn.Module) -> dict[str, int]:
    """Tensor name -> the dim that ``style`` splits over tp on ``module`` (what torch's styles and ours do)."""
    if isinstance(module, nn.Linear):
        if isinstance(style, ColwiseParallel):
            return {"weight": 0, "bias": 0}
        if isinstance(style, RowwiseParallel):
            return {"weight": 1}  # the bias is added once, after the sum
    if isinstance(module, nn.Embedding):
        if isinstance(style, ColwiseParallel):
            return {"weight": 1}
        if isinstance(style, RowwiseParallel):
            return {"weight": 0}
    if isinstance(style, ChannelOutParallel):
        return {"weight": 0, "bias": 0}
    if isinstance(style, ChannelInParallel):
        return {"weight": 1}
    if isinstance(style, ChannelNormParallel):
        return {name: 0 for name in ("weight", "bias", "running_mean", "running_var")}
    return {}


def _styled(layer: nn.Module, prefix: str, plan: Mapping[str, ParallelStyle]) -> Iterator[tuple[nn.Module, Any]]:
    for name, module in layer.named_modules():
        path = f"{prefix}.{name}" if name else prefix
        for pattern, style in plan.items():
            if _matches(path, pattern):
                yield module, style


def local_copy(layer: nn.Module, prefix: str, plan: Mapping[str, ParallelStyle], tp: int) -> nn.Module:
    """A copy of a meta-device layer with every tensor the plan splits cut to one tp rank's shard, on the host."""
    local = copy.deepcopy(layer)
    for module, style in _styled(local, prefix, plan):
        for name, dim in split_dims(style, module).items():
            t = getattr(module, name, None)
            if t is None:
                continue
            shape = list(t.shape)
            shape[dim] //= tp
            new = torch.empty(shape, dtype=t.dtype, device="meta")
            setattr(module, name, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new)
    return local.to_empty(device="cpu")


def _precision_context(precision: str) -> contextlib.AbstractContextManager:
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


def _tp_payload_hooks(layer: nn.Module, prefix: str, plan: Mapping[str, ParallelStyle], sink: dict) -> list:
    """Hooks adding up the bytes tp all-reduces: each row-parallel module's output (forward), each distinct
    input of a column-parallel module (its gradient is a partial sum, reduced in backward)."""
    handles = []
    for module, style in _styled(layer, prefix, plan):
        row = isinstance(style, (RowwiseParallel, ChannelInParallel))
        col = isinstance(style, ChannelOutParallel) or (
            isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear)
        )

        def hook(mod: nn.Module, args: tuple, out: Tensor, row: bool = row, col: bool = col) -> None:
            if row:
                sink["bytes"] += out.nbytes
            if col and args[0].data_ptr() not in sink["inputs"]:
                sink["inputs"].add(args[0].data_ptr())
                sink["bytes"] += args[0].nbytes

        if row or col:
            handles.append(module.register_forward_hook(hook))
    return handles


def _measure(
    layer: nn.Module, x: Tensor, loss: Callable | None, batch: int, precision: str, tp_hooks: Callable
) -> dict:
    """One forward of ``layer`` on ``x``: bytes left for backward (output included), what the loss adds, FLOPs,
    the bytes tp all-reduces, and the output's shape and dtype."""
    sink: dict[str, Any] = {"bytes": 0, "inputs": set()}
    handles = tp_hooks(layer, sink)
    routed, norms = [0], [0]

    def count_norm_inputs(mod: nn.Module, args: tuple, out: Tensor) -> None:  # what sequence parallelism splits
        norms[0] += args[0].nbytes

    handles += [m.register_forward_hook(count_norm_inputs) for m in layer.modules() if isinstance(m, NORMS)]

    def count_rows(mod: nn.Module, args: tuple, out: Tensor) -> None:  # one all-to-all's payload: tokens x k x d
        routed[0] += args[0].numel() * mod.top_k * args[0].element_size()

    handles += [m.register_forward_hook(count_rows) for m in layer.modules() if isinstance(m, MoE)]
    try:
        with ActivationMemory(exclude=layer) as meter, _precision_context(precision):
            out = layer(x)
            act = meter.sample()
            shape, dtype = tuple(out.shape), out.dtype
            extra = 0
            if loss is not None:
                # as in a training step: the output is let go once the loss holds what its backward needs (a
                # log-softmax saves its result, not the logits)
                value = loss(out, batch)
                del out
                extra = meter.sample() - act
                del value
    finally:
        for h in handles:
            h.remove()
    # a separate forward: under FlopCounterMode autograd saves more (one more activation per GPT block)
    padded = _padding_hooks(layer)
    try:
        with FlopCounterMode(display=False) as counter, _precision_context(precision):
            layer(x)
    finally:
        for h in padded["handles"]:
            h.remove()
    return {
        "act": act,
        "loss": extra,
        "shape": shape,
        "dtype": dtype,
        "flops": counter.get_total_flops() - _padding_flops(layer, counter, padded["share"]),
        "tp": sink["bytes"],
        "a2a": routed[0],
        "norm": norms[0],
    }


def _padding_hooks(layer: nn.Module) -> dict[str, Any]:
    """Hooks noting, for each expert module of ``layer``, the share of its FLOPs spent on padding rows: the padded
    host kernel runs every local expert at the largest count (:mod:`~lightning_parallel.parallel.expert.experts`),
    and the profile's routing (uninitialized weights, constant inputs) sends every token to the same k experts,
    which no trained or freshly initialized router does. The model counts the routed rows alone (dropless)."""
    found: dict[str, Any] = {"handles": [], "share": {}}
    for name, module in layer.named_modules():
        if isinstance(module, GroupedExperts):

            def hook(mod: nn.Module, args: tuple, out: Tensor, name: str = name) -> None:
                counts = args[1]
                padded = counts.numel() * int(counts.max()) if counts.numel() else 0
                found["share"][name] = 1 - int(counts.sum()) / padded if padded else 0.0

            found["handles"].append(module.register_forward_hook(hook))
    return found


def _padding_flops(layer: nn.Module, counter: FlopCounterMode, share: dict[str, float]) -> float:
    """The padding rows' FLOPs of the expert modules ``share`` names (FlopCounterMode counts by module path under
    the root's class name)."""
    counts, root = counter.get_flop_counts(), type(layer).__name__
    return sum(sum(counts.get(f"{root}.{name}" if name else root, {}).values()) * w for name, w in share.items())


def layer_costs(
    spec: ModelSpec, tp: int, precision: str = "32-true", activation_checkpointing: str = "none"
) -> list[LayerCost]:
    """Each pipeline layer's :class:`LayerCost` on one tp rank, measured at micro-batch sizes 1 and 2, each layer
    checkpointed as ``activation_checkpointing`` says (``none``, ``full``, ``selective``: the strategy's own
    :func:`~lightning_parallel.parallel.activation_checkpoint.apply_activation_checkpointing`, so what it keeps is
    measured, not modeled).

    Layers of the same shape (a GPT's blocks) are measured once. Parameters are counted exactly from the
    local copies; a weight shared by two layers (a tied embedding and head) keeps one key, so a stage
    holding both counts it once.
    """
    check_precision(precision)
    names = {id(p): n for n, p in spec.model.named_parameters()}  # the first name of each (tied) parameter
    paths = {id(m): n for n, m in spec.model.named_modules()}
    cache: dict[tuple, tuple[dict, tuple, torch.dtype]] = {}
    inputs = {b: spec.make_input(b) for b in (1, 2)}
    costs = []
    for i, layer in enumerate(spec.layers):
        prefix = paths[id(layer)]
        local = local_copy(layer, prefix, spec.plan, tp)
        if precision == "bf16-true":
            local = local.to(torch.bfloat16)
        apply_activation_checkpointing([local], activation_checkpointing)
        params = {names[id(p)]: local.get_parameter(n).numel() for n, p in layer.named_parameters()}
        experts = frozenset(
            names[id(p)]
            for path, sub in layer.named_modules()
            if isinstance(sub, GroupedExperts)
            for p in sub.parameters()
        )
        loss = spec.loss if i == len(spec.layers) - 1 else None
        runs = {}
        for b in (1, 2):
            x = inputs[b]
            key = (type(layer).__name__, repr(local), _signature(local), tuple(x.shape), x.dtype, loss is None)
            if key not in cache:
                run = _measure(
                    local, x, loss, b, precision, lambda m, s, p=prefix: _tp_payload_hooks(m, p, spec.plan, s)
                )
                cache[key] = (run, run.pop("shape"), run.pop("dtype"))
            run, shape, dtype = cache[key]
            runs[b] = {**run, "in": x.nbytes}
            inputs[b] = torch.zeros(shape, dtype=dtype, requires_grad=dtype.is_floating_point)  # the next input
        adapters = lora_params(local, prefix, spec.lora_rank, spec.lora_targets) if spec.lora_rank else 0
        costs.append(
            dataclasses.replace(_layer_cost(params, runs, inputs), expert_params=experts, adapter_params=adapters)
        )
    return costs


def _signature(module: nn.Module) -> tuple:
    """What decides a layer's computation: tensor shapes and every plain attribute of every submodule (a
    pool flag, a head count), except ``index``, which only seeds initial values in the recipe models."""
    shapes = tuple((n, tuple(t.shape)) for n, t in [*module.named_parameters(), *module.named_buffers()])
    plain = (bool, int, float, str, type(None))
    attrs = tuple(
        (path, k, v)
        for path, sub in module.named_modules()
        for k, v in sorted(vars(sub).items())
        if isinstance(v, plain) and k != "index"
    )
    return shapes, attrs


def _layer_cost(params: dict[str, int], runs: dict[int, dict], outputs: dict[int, Tensor]) -> LayerCost:
    def line(key: str) -> tuple[float, float]:  # (fixed, per sample) through the sizes 1 and 2
        slope = runs[2][key] - runs[1][key]
        return runs[1][key] - slope, slope

    act, loss = line("act"), line("loss")
    return LayerCost(
        params=params,
        act_fixed=act[0],
        act_per_sample=act[1],
        loss_fixed=loss[0],
        loss_per_sample=loss[1],
        in_per_sample=runs[2]["in"] - runs[1]["in"],
        out_per_sample=outputs[2].nbytes - outputs[1].nbytes,
        flops_per_sample=runs[2]["flops"] - runs[1]["flops"],
        tp_payload_per_sample=runs[2]["tp"] - runs[1]["tp"],
        a2a_per_sample=runs[2]["a2a"] - runs[1]["a2a"],
        norm_in_per_sample=runs[2]["norm"] - runs[1]["norm"],
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recomputed(costs: list[LayerCost]) -> list[LayerCost]:
    """``costs`` (profiled under full activation checkpointing, so their memory is measured) with the time the
    recompute adds: each layer runs its forward again in backward (4/3 of the FLOPs) and repeats its forward's tp
    all-reduces (1.5x the payload)."""
    return [
        dataclasses.replace(
            c, flops_per_sample=c.flops_per_sample * 4 / 3, tp_payload_per_sample=c.tp_payload_per_sample * 1.5
        )
        for c in costs
    ]


def plan_layouts(
    spec: ModelSpec,
    world: int,
    settings: Settings,
    checkpointing: str = "none",
    profiles: dict[tuple[int, str], list[LayerCost]] | None = None,
) -> list[Estimate]:
    """One estimate per (pp, dp, tp, zero_stage) with pp * dp * tp == world; infeasible ones carry the reason
    (a layout refused before estimating has ``zero_stage`` None: the reason holds for every stage). Each layout
    is validated as the strategy would validate it (:class:`ParallelConfig`).

    Args:
        spec: the model; world: the devices; settings: batch, precision, device and cost model.
        checkpointing: ``none`` (then ``settings.activation_checkpointing`` holds) or ``full``: every layer
            profiled checkpointed, its recompute timed by :func:`recomputed`.
        profiles: per (tp, checkpointing), the layer costs measured already (filled in as they are measured),
            to plan again without profiling again.
    """
    if checkpointing not in ("none", "full"):
        raise ValueError(f"checkpointing={checkpointing!r}: the profiled planner plans 'none' or 'full'.")
    mode = settings.activation_checkpointing if checkpointing == "none" else checkpointing
    out: list[Estimate] = []
    profiles = {} if profiles is None else profiles
    num_layers = len(spec.layers)
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            config, reason = _layout(spec, settings, num_layers, pp, dp, tp)
            if reason:
                out.append(Estimate(pp, dp, tp, None, reason=reason))
                continue
            if (tp, mode) not in profiles:
                profiles[tp, mode] = layer_costs(spec, tp, settings.precision, mode)
            stages = uniform_partition(num_layers, pp * config.stages_per_rank)
            ranks = config.schedule.stage_ranks(len(stages), pp)
            expert_degrees = [ep for ep in divisors(dp) if spec.num_experts % ep == 0] if spec.num_experts else [1]
            for ep in expert_degrees:
                for zero in [stage for stage in planned_stages() if dp > 1 or stage == 0]:
                    costs = recomputed(profiles[tp, mode]) if mode == "full" else profiles[tp, mode]
                    est = estimate_layout(costs, stages, ranks, (pp, dp, tp), zero, settings, ep=ep)
                    if est.memory > settings.device_memory:
                        memory, device = est.memory / 1e9, settings.device_memory / 1e9
                        est.reason = f"out of memory: {memory:.2f} GB > {device:.2f} GB"
                    out.append(est)
    return out


def _layout(spec: ModelSpec, s: Settings, num_layers: int, pp: int, dp: int, tp: int) -> tuple[ParallelConfig, str]:
    """The layout's validated config, and why it cannot run at all ("" if it can), in the strategy's own words."""
    virtual = s.virtual_stages if pp > 1 else None  # the schedule's stages per rank (checked against it)
    config = ParallelConfig(dp=dp, pp=pp, tp=tp, pp_schedule=s.schedule, microbatches=s.microbatches)
    config.pp_virtual_stages = virtual
    try:
        spec.check_tp(tp)
        config = config.validate(warn=lambda message: None)
    except ValueError as err:
        return config, str(err)
    if pp * config.stages_per_rank > num_layers:
        return config, f"pp={pp} x {config.stages_per_rank} stage(s) per rank > {num_layers} pipeline layers"
    if s.global_batch % dp:
        return config, f"global batch {s.global_batch} does not split over dp={dp}"
    if pp > 1 and (s.global_batch // dp) % config.microbatches:
        return (
            config,
            f"microbatches={config.microbatches} do not divide the {s.global_batch // dp} samples per dp rank",
        )
    return config, ""
