"""``strategy=auto``: the planner's layout for the job at hand, chosen before any process group exists.

:func:`detect_machine` describes the job (world size, node size, memory per device, the step-time model's FLOP/s,
bandwidth and latency per message) from torch alone, the same on every rank: no timing, so every process that
plans for the same job picks the same layout. :func:`choose_layout` runs the planner
(:func:`~lightning_parallel.planning.profile.plan_layouts`, :func:`~lightning_parallel.planning.estimate.recommend`)
over every layout whose tp fits inside a node, without and with full activation checkpointing (and with each
sharding registered with ``planned = True``), and returns the recommendation as a
:class:`~lightning_parallel.parallel.config.ParallelConfig` with its predicted figures; a model given by its shape
(a Hugging Face config, a LitGPT name) goes to the analytic planner over every axis (:mod:`.auto_analytic`). The
recipes use it for
``strategy=auto`` (``recipes/auto.py``); Trainer and Fabric users pass ``choice.config`` to
``Hybrid3DStrategy`` / ``Hybrid3DFabricStrategy``.

Host (CPU, gloo) constants of the step-time model, fitted to ``make bench``'s measured step times of ``gpt_bench``
at world 2 on one core per rank (benchmarks/results.json: dp with ZeRO 0-3, tp=2, pp=2; least squares on the
planner's FLOPs, bytes and message counts): 52 GFLOP/s per core, 0.42 GB/s per rank, 1.6 ms per message. They
rank those six layouts as measured at the top (dp ZeRO-0 first, within 3%); the absolute times are rough.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.planning.analytic import AnalyticEstimate
from lightning_parallel.planning.auto_analytic import analytic_candidates, machine_cluster
from lightning_parallel.planning.estimate import Estimate, Settings, recommend
from lightning_parallel.planning.fp8 import check_fp8_device
from lightning_parallel.planning.hf_config import ModelShape, from_hf_config
from lightning_parallel.planning.layout import Workload
from lightning_parallel.planning.muon import states_per_param
from lightning_parallel.planning.profile import ModelSpec, plan_layouts
from lightning_parallel.planning.search import Refusal

HOST_FLOPS_PER_CORE = 52e9
HOST_BANDWIDTH = 0.42e9
HOST_LATENCY = 1.6e-3
# an accelerator's: the planner's defaults (sustained FLOP/s, bytes/s each rank sends) and a collective's launch
DEVICE_FLOPS, DEVICE_BANDWIDTH, DEVICE_LATENCY = Settings.device_flops, Settings.bandwidth, 20e-6


@dataclass(frozen=True)
class Machine:
    """The job a layout is chosen for.

    Attributes:
        world_size: processes (devices) in the job; node_size: processes per node (tp stays inside a node).
        device_memory: bytes per device (per process on the host).
        device_flops, bandwidth, latency: the step-time model's FLOP/s and bytes/s per rank, seconds per message.
        kind: "cuda" or "cpu", what the figures describe.
        device: the GPU's row of the analytic planner's device table (``planning/cluster.py``: ``h100``, ...) when
            it is one of them; None: a device of the figures above.
    """

    world_size: int
    node_size: int
    device_memory: float
    device_flops: float
    bandwidth: float
    latency: float
    kind: str
    device: str | None = None


@dataclass(frozen=True)
class GPU:
    """What the planner reads of a GPU: torch's name for it and its memory in bytes."""

    name: str
    memory: float


def read_gpu(index: int) -> GPU:
    """CUDA device ``index``'s name and memory (``torch.cuda.get_device_properties``). Read once, by the process that
    plans, for the device it has chosen (``recipes/auto.py``: the launcher's parent before any worker starts; under
    torchrun each rank for its own device once set), so no process touches a device it will not use."""
    props = torch.cuda.get_device_properties(index)
    return GPU(props.name, float(props.total_memory))


def host_memory() -> float:
    """Bytes of the host's physical memory."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def detect_machine(
    world_size: int,
    node_size: int,
    accelerator: str = "auto",
    device_memory: float | None = None,
    gpu: GPU | None = None,
) -> Machine:
    """The job on this machine: CUDA's device memory where the accelerator is a GPU, else the host's memory shared
    by the node's processes, with the step-time constants of that kind.

    Args:
        world_size: processes in the job (``trainer.devices * trainer.num_nodes``).
        node_size: processes per node (``trainer.devices``).
        accelerator: Lightning's accelerator flag (``auto``: a GPU where CUDA is there).
        device_memory: bytes per device instead of what is detected.
        gpu: the GPU as read once by the process that plans (:func:`read_gpu`); None: read here, from the current
            CUDA device (set it first: an unset device is device 0 in every process).
    """
    if world_size < 1 or node_size < 1 or world_size % node_size:
        raise ValueError(
            f"strategy=auto: world size {world_size} is not a whole number of nodes of {node_size} devices: set "
            "trainer.devices (per node) and trainer.num_nodes to 1 or more."
        )
    cuda = accelerator in ("auto", "gpu", "cuda") and (gpu is not None or torch.cuda.is_available())
    if cuda:
        gpu = gpu if gpu is not None else read_gpu(torch.cuda.current_device())
        memory = device_memory or gpu.memory
        name = device_row(gpu.name, gpu.memory)
        return Machine(world_size, node_size, memory, DEVICE_FLOPS, DEVICE_BANDWIDTH, DEVICE_LATENCY, "cuda", name)
    cores = os.cpu_count() or 1
    memory = device_memory or host_memory() / node_size
    # each process runs max(1, cores // node_size) threads (recipes/launch.py), on at most its share of the cores
    flops = HOST_FLOPS_PER_CORE * min(max(1, cores // node_size), cores / node_size)
    return Machine(world_size, node_size, memory, flops, HOST_BANDWIDTH, HOST_LATENCY, "cpu")


class NoLayoutFits(ValueError):
    """No layout of the job fits the memory per device (the message names the smallest and the fixes)."""


def device_row(name: str, memory: float) -> str | None:
    """The device table's row of a GPU called ``name`` (torch's device name) with ``memory`` bytes, None if none."""
    lowered = name.lower()
    for key in ("h200", "h100", "mi300x"):
        if key in lowered:
            return key
    if "a100" in lowered:
        return "a100-80gb" if memory > 50e9 else "a100-40gb"
    return None


@dataclass
class AutoChoice:
    """The chosen layout: ``config`` for the strategy, ``estimate`` its predicted figures (the profiled planner's
    :class:`Estimate` for a :class:`ModelSpec`, the analytic planner's :class:`AnalyticEstimate` for a model shape),
    ``settings`` what it was estimated for (:class:`Settings` or :class:`Workload`)."""

    config: ParallelConfig
    estimate: Estimate | AnalyticEstimate
    machine: Machine
    settings: Settings | Workload

    def planned(self) -> dict[str, Any]:
        """What metrics.json's ``planned`` holds: the layout and its predicted memory per rank and step time."""
        e, common = self.estimate, {"device_memory_bytes": self.machine.device_memory, "machine": self.machine.kind}
        if isinstance(e, AnalyticEstimate):
            c, default = self.config, ParallelConfig()
            layout = {f.name: getattr(c, f.name) for f in fields(c) if getattr(c, f.name) != getattr(default, f.name)}
            return {
                "layout": {**layout, **{k: getattr(c, k) for k in ("dp", "pp", "tp", "ep", "zero_stage")}},
                "memory_per_rank_bytes": e.memory,
                "step_time_s": e.step_time,
                "times_s": dict(e.times),
                "bound": e.bound,
                "counts": dict(e.counts),
                "planner": "analytic",
                **common,
            }
        c, extra = self.config, ("activation_checkpointing", "sharding")
        extras = {k: getattr(c, k) for k in extra if getattr(c, k) != getattr(ParallelConfig, k)}
        return {
            "layout": {"dp": e.dp, "pp": e.pp, "tp": e.tp, "ep": e.ep, "zero_stage": c.zero_stage, **extras},
            "microbatches": e.microbatches,
            "memory_per_rank_bytes": max(e.memory_per_rank),  # the busiest pp rank's
            "memory_by_pp_rank_bytes": list(e.memory_per_rank),
            "step_time_s": e.step_time,
            "comm_bytes_per_step": dict(e.comm),
            "bubble": e.bubble,
            **common,
        }

    def describe(self) -> str:
        e = self.estimate
        c = self.config
        extra = f", microbatches={c.microbatches}" if c.pp > 1 else ""
        for key in ("pp_virtual_stages", "sequence_parallel", "activation_checkpointing", "overlap_grad_reduce"):
            extra += f", {key}={getattr(c, key)}" if getattr(c, key) != getattr(ParallelConfig, key) else ""
        return (
            f"strategy=auto on {self.machine.world_size} {self.machine.kind} device(s), {self.machine.node_size} per "
            f"node, {_size(self.machine.device_memory)} each: {self.config.describe()}{extra}"
            f"; predicted {_size(e.memory)} per rank, {e.step_time * 1e3:.2f} ms per step"
        )


def choose_layout(
    model: ModelSpec | ModelShape | dict | str | Path,
    machine: Machine,
    global_batch: int,
    precision: str = "32-true",
    margin: float = 0.1,
    seq_len: int | None = None,
    refuses: Refusal | None = None,
    optimizer: str = "adamw",
) -> AutoChoice:
    """The planner's recommendation for ``machine``: the fastest predicted layout that fits, tp inside a node.

    A :class:`ModelSpec` (a model built on the meta device) is profiled on the host and planned over dp, pp, tp,
    ep, the ZeRO stage (and each registered sharding that asks to be planned) and full activation checkpointing,
    its memory exact. A model shape (a :class:`ModelShape`, a Hugging Face ``config.json`` as a dict, a path to
    it or its folder, or a LitGPT model name) is planned by the analytic planner over every axis it models: tp
    with sequence parallelism, cp (from 2048 tokens per rank), pp with virtual stages and microbatches, dp with
    ZeRO 0-3 and HSDP across nodes, ep, and selective or full activation checkpointing.

    Args:
        model: the model, as above (``lightning_parallel.plan.gpt_spec`` / ``vgg_spec`` / ``recipe_shape`` for the
            recipe models).
        machine: the job (:func:`detect_machine`).
        global_batch: samples per forward and backward over the whole job.
        precision: Lightning's precision flag.
        margin: the fraction of device memory to keep free when a layout allows it.
        seq_len: tokens per sample for a model shape (None: the model's context length).
        refuses: for a model shape, why its family refuses a layout ("" if it takes it:
            :mod:`lightning_parallel.recipes.family`); such layouts are never chosen.
        optimizer: ``adamw`` (a :class:`ModelSpec`'s own ``optimizer_states``) or ``muon``: a model shape's state,
            exchange and Newton-Schulz counted (:mod:`.muon`); a ModelSpec's states at the model's average per
            parameter (:func:`.muon.states_per_param`, exact at pp=1), no exchange or Newton-Schulz time.
            ``precision="fp8"``: a model shape's converted linears at the device's fp8 peak; a profiled
            :class:`ModelSpec` is planned as ``bf16-mixed`` holds it (one FLOP/s figure, no fp8 speed-up).
    """
    if not isinstance(model, ModelSpec):
        work = Workload(1, global_batch, precision=precision, margin=margin, optimizer=optimizer)
        return _choose_analytic(model_shape(model), machine, work, seq_len, refuses)
    if optimizer == "muon":  # its states at the model's average per parameter (no exchange, no Newton-Schulz)
        model = replace(model, optimizer_states=states_per_param(model.model, model.optimizer_states))
    elif optimizer != "adamw":
        raise ValueError(f"choose_layout(optimizer={optimizer!r}): plan 'adamw' (the model's own) or 'muon'.")
    if seq_len is not None:
        raise ValueError(
            f"choose_layout(seq_len={seq_len}): a ModelSpec is profiled at the sequence its make_input builds; set "
            "the length there (gpt_spec of a config with that block_size), or leave seq_len=None."
        )
    settings = auto_settings(model, machine, global_batch, precision, margin)
    profiles: dict[tuple[int, str], list] = {}  # each (tp, checkpointing) measured once
    plain = candidates(model, machine, settings, profiles=profiles)
    full = candidates(model, machine, settings, "full", profiles)
    best = recommend(plain + full, settings.device_memory, settings.margin)
    if best is None:
        raise _no_layout(plain + full, machine, global_batch)
    stage, sharding = int(best.zero_stage or 0), getattr(best.zero_stage, "sharding", None)  # a variant by name
    config = ParallelConfig(dp=best.dp, pp=best.pp, tp=best.tp, ep=best.ep, zero_stage=stage, sharding=sharding)
    config.activation_checkpointing = "full" if any(best is e for e in full) else "none"
    if best.pp > 1:
        config = replace(config, microbatches=best.microbatches, pp_schedule=settings.schedule)
    return AutoChoice(config, best, machine, settings)


def model_shape(model: ModelShape | dict | str | Path) -> ModelShape:
    """The analytic planner's view of ``model``: a :class:`ModelShape` as is, a Hugging Face config (a dict, a
    ``config.json`` or a folder holding one), or a LitGPT model name."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        return from_hf_config(model)
    if isinstance(model, (str, Path)):
        from lightning_parallel.planning.scale_cli import load_shape

        return load_shape(str(model))
    raise TypeError(
        f"strategy=auto: model={type(model).__name__} is not a model to plan: pass a ModelSpec "
        "(lightning_parallel.plan.gpt_spec), a ModelShape, a Hugging Face config (dict, config.json or folder) or a "
        "LitGPT model name."
    )


def _choose_analytic(
    shape: ModelShape, machine: Machine, work: Workload, seq_len: int | None, refuses: Refusal | None
) -> AutoChoice:
    work = replace(work, seq_len=seq_len or shape.seq_len)
    cluster, global_batch = machine_cluster(machine), work.global_batch
    check_fp8_device(cluster.device, work.precision)
    estimates = analytic_candidates(shape, cluster, work, refuses)
    fits = [e for e in estimates if e.feasible]
    if not fits:
        least = min(estimates, key=lambda e: e.memory, default=None)
        smallest = f"the smallest ({least.layout.describe()}) needs {_size(least.memory)} per rank" if least else ""
        raise NoLayoutFits(
            f"strategy=auto: no layout of {shape.name or 'the model'} fits {_size(machine.device_memory)} per device "
            f"on {machine.world_size} device(s); {smallest or 'no split of the devices is valid'}: add devices, lower "
            f"the global batch ({global_batch}) or the sequence ({work.seq_len}), or give the real memory per device."
        )
    best = min(fits, key=lambda e: (e.step_time, e.memory))
    layout = asdict(best.layout)
    layout.update(zero_stage=int(best.layout.zero_stage), sharding=getattr(best.layout.zero_stage, "sharding", None))
    if best.layout.pp == 1:
        layout.update(microbatches=None, pp_schedule="1f1b", pp_virtual_stages=None)
    if layout["zero_stage"] == 3:  # FSDP2 overlaps by itself; the strategy would warn that it ignores the setting
        layout["overlap_grad_reduce"] = False
    return AutoChoice(ParallelConfig(**layout), best, machine, work)


def candidates(
    spec: ModelSpec, machine: Machine, settings: Settings, checkpointing: str = "none", profiles: dict | None = None
) -> list[Estimate]:
    """The planner's estimate of every layout of ``machine.world_size`` (under ``checkpointing``, ``none`` or
    ``full``; ``profiles`` as :func:`plan_layouts`'s); those whose tp would span nodes are infeasible (tp's
    all-reduces in every layer stay on the fast link inside a node)."""
    estimates = plan_layouts(spec, machine.world_size, settings, checkpointing, profiles)
    for e in estimates:
        if e.feasible and machine.node_size % e.tp:
            e.reason = f"tp={e.tp} spans nodes of {machine.node_size} device(s)"
    return estimates


def auto_settings(
    spec: ModelSpec, machine: Machine, global_batch: int, precision: str = "32-true", margin: float = 0.1
) -> Settings:
    """The planner's :class:`Settings` for ``machine`` (what :func:`choose_layout` estimates with)."""
    if global_batch < 1:
        raise ValueError(f"strategy=auto: the global batch ({global_batch}) must be at least 1 sample per step.")
    return Settings(
        global_batch=global_batch,
        precision=precision,
        optimizer_states=spec.optimizer_states,
        device_memory=machine.device_memory,
        margin=margin,
        device_flops=machine.device_flops,
        bandwidth=machine.bandwidth,
        latency=machine.latency,
    )


def _no_layout(estimates: list[Estimate], machine: Machine, global_batch: int) -> ValueError:
    """Why no layout can run, and the fix: the smallest memory when every split ran out of it (NoLayoutFits)."""
    sized = [e for e in estimates if e.zero_stage is not None and e.memory_per_rank and "memory" in e.reason]
    if sized:
        least = min(sized, key=lambda e: e.memory)
        return NoLayoutFits(
            f"strategy=auto: no layout fits {_size(machine.device_memory)} per device on {machine.world_size} "
            f"device(s); the smallest (pp={least.pp}, dp={least.dp}, tp={least.tp}, zero_stage={least.zero_stage}) "
            f"needs {_size(least.memory)} per rank: add devices (trainer.devices, trainer.num_nodes), lower the "
            f"global batch ({global_batch}: data.global_batch_size), or give the real memory per device "
            "(strategy.auto_device_memory) if it is larger."
        )
    reasons = sorted({e.reason for e in estimates if e.reason})
    return ValueError(
        f"strategy=auto: no layout of {machine.world_size} device(s) can run this model ({'; '.join(reasons)}): "
        "change trainer.devices or data.global_batch_size, or pick a layout with strategy=hybrid3d."
    )


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"
