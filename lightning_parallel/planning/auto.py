"""``strategy=auto``: the planner's layout for the job at hand, chosen before any process group exists.

:func:`detect_machine` describes the job (world size, node size, memory per device, the step-time model's FLOP/s,
bandwidth and latency per message) from torch alone, the same on every rank: no timing, so every process that
plans for the same job picks the same layout. :func:`choose_layout` runs the planner
(:func:`~lightning_parallel.planning.profile.plan_layouts`, :func:`~lightning_parallel.planning.estimate.recommend`)
over every layout whose tp fits inside a node and returns the recommendation as a
:class:`~lightning_parallel.parallel.config.ParallelConfig` with its predicted figures. The recipes use it for
``strategy=auto`` (``recipes/auto.py``); Trainer and Fabric users pass ``choice.config`` to
``Hybrid3DStrategy`` / ``Hybrid3DFabricStrategy``.

Host (CPU, gloo) constants of the step-time model, fitted to ``make bench``'s measured step times of ``gpt_bench``
at world 2 on one core per rank (benchmarks/results.json: dp with ZeRO 0-3, tp=2, pp=2; least squares on the
planner's FLOPs, bytes and message counts): 52 GFLOP/s per core, 0.42 GB/s per rank, 1.6 ms per message. They
rank those six layouts as measured at the top (dp ZeRO-0 first, within 3%); the absolute times are rough.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.planning.estimate import Estimate, Settings, recommend
from lightning_parallel.planning.profile import ModelSpec, plan_layouts

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
    """

    world_size: int
    node_size: int
    device_memory: float
    device_flops: float
    bandwidth: float
    latency: float
    kind: str


def host_memory() -> float:
    """Bytes of the host's physical memory."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def detect_machine(
    world_size: int, node_size: int, accelerator: str = "auto", device_memory: float | None = None
) -> Machine:
    """The job on this machine: CUDA's device memory where the accelerator is a GPU, else the host's memory shared
    by the node's processes, with the step-time constants of that kind.

    Args:
        world_size: processes in the job (``trainer.devices * trainer.num_nodes``).
        node_size: processes per node (``trainer.devices``).
        accelerator: Lightning's accelerator flag (``auto``: a GPU where CUDA is there).
        device_memory: bytes per device instead of what is detected.
    """
    if world_size < 1 or node_size < 1 or world_size % node_size:
        raise ValueError(
            f"strategy=auto: world size {world_size} is not a whole number of nodes of {node_size} devices: set "
            "trainer.devices (per node) and trainer.num_nodes to 1 or more."
        )
    cuda = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    if cuda:
        memory = device_memory or float(torch.cuda.get_device_properties(0).total_memory)
        return Machine(world_size, node_size, memory, DEVICE_FLOPS, DEVICE_BANDWIDTH, DEVICE_LATENCY, "cuda")
    cores = os.cpu_count() or 1
    memory = device_memory or host_memory() / node_size
    # each process runs max(1, cores // node_size) threads (recipes/launch.py), on at most its share of the cores
    flops = HOST_FLOPS_PER_CORE * min(max(1, cores // node_size), cores / node_size)
    return Machine(world_size, node_size, memory, flops, HOST_BANDWIDTH, HOST_LATENCY, "cpu")


@dataclass
class AutoChoice:
    """The chosen layout: ``config`` for the strategy, ``estimate`` its predicted figures."""

    config: ParallelConfig
    estimate: Estimate
    machine: Machine
    settings: Settings

    def planned(self) -> dict[str, Any]:
        """What metrics.json's ``planned`` holds: the layout and its predicted memory per rank and step time."""
        e = self.estimate
        return {
            "layout": {"dp": e.dp, "pp": e.pp, "tp": e.tp, "ep": e.ep, "zero_stage": e.zero_stage},
            "microbatches": e.microbatches,
            "memory_per_rank_bytes": max(e.memory_per_rank),  # the busiest pp rank's
            "memory_by_pp_rank_bytes": list(e.memory_per_rank),
            "step_time_s": e.step_time,
            "comm_bytes_per_step": dict(e.comm),
            "bubble": e.bubble,
            "device_memory_bytes": self.machine.device_memory,
            "machine": self.machine.kind,
        }

    def describe(self) -> str:
        e = self.estimate
        return (
            f"strategy=auto on {self.machine.world_size} {self.machine.kind} device(s), {self.machine.node_size} per "
            f"node, {_size(self.machine.device_memory)} each: {self.config.describe()}"
            + (f", microbatches={e.microbatches}" if e.pp > 1 else "")
            + f"; predicted {_size(e.memory)} per rank, {e.step_time * 1e3:.2f} ms per step"
        )


def choose_layout(
    spec: ModelSpec, machine: Machine, global_batch: int, precision: str = "32-true", margin: float = 0.1
) -> AutoChoice:
    """The planner's recommendation for ``machine``: the fastest predicted layout that fits, tp inside a node.

    Args:
        spec: the model, as the planner sees it (``lightning_parallel.plan.gpt_spec`` / ``vgg_spec`` for the
            recipe models).
        machine: the job (:func:`detect_machine`).
        global_batch: samples per forward and backward over the whole job.
        precision: Lightning's precision flag.
        margin: the fraction of device memory to keep free when a layout allows it.
    """
    settings = auto_settings(spec, machine, global_batch, precision, margin)
    estimates = candidates(spec, machine, settings)
    best = recommend(estimates, settings.device_memory, settings.margin)
    if best is None:
        raise ValueError(_no_layout(estimates, machine, global_batch))
    config = ParallelConfig(dp=best.dp, pp=best.pp, tp=best.tp, ep=best.ep, zero_stage=best.zero_stage)
    if best.pp > 1:
        config = replace(config, microbatches=best.microbatches, pp_schedule=settings.schedule)
    return AutoChoice(config, best, machine, settings)


def candidates(spec: ModelSpec, machine: Machine, settings: Settings) -> list[Estimate]:
    """The planner's estimate of every layout of ``machine.world_size``; those whose tp would span nodes are
    infeasible (tp's all-reduces in every layer stay on the fast link inside a node)."""
    estimates = plan_layouts(spec, machine.world_size, settings)
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


def _no_layout(estimates: list[Estimate], machine: Machine, global_batch: int) -> str:
    """Why no layout can run, and the fix: the smallest memory when every split ran out of it."""
    sized = [e for e in estimates if e.zero_stage is not None and e.memory_per_rank and "memory" in e.reason]
    if sized:
        least = min(sized, key=lambda e: e.memory)
        return (
            f"strategy=auto: no layout fits {_size(machine.device_memory)} per device on {machine.world_size} "
            f"device(s); the smallest (pp={least.pp}, dp={least.dp}, tp={least.tp}, zero_stage={least.zero_stage}) "
            f"needs {_size(least.memory)} per rank: add devices (trainer.devices, trainer.num_nodes), lower the "
            f"global batch ({global_batch}: data.global_batch_size), or give the real memory per device "
            "(strategy.auto_device_memory) if it is larger."
        )
    reasons = sorted({e.reason for e in estimates if e.reason})
    return (
        f"strategy=auto: no layout of {machine.world_size} device(s) can run this model ({'; '.join(reasons)}): "
        "change trainer.devices or data.global_batch_size, or pick a layout with strategy=hybrid3d."
    )


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"
