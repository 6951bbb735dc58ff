"""``strategy=auto``'s use of the analytic planner (:mod:`.analytic`): the job's devices as a :class:`Cluster`, every
axis searched for a model given by its shape (a Hugging Face config, a LitGPT name), and, for a profiled model, the
axes the profile does not vary (activation checkpointing, sequence parallelism) as the analytic formulas' ratio to
the same layout without them, applied to the profiled figures (the profile calibrates the analytic model).
Pure Python."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lightning_parallel.planning.analytic import AnalyticEstimate, evaluate
from lightning_parallel.planning.cluster import COMM_EFFICIENCY, DEVICES, Cluster, Device
from lightning_parallel.planning.estimate import Estimate, Settings
from lightning_parallel.planning.hf_config import ModelShape
from lightning_parallel.planning.layout import CHECKPOINTING, Layout, Workload, layout_error
from lightning_parallel.planning.search import SEARCHED, best_of, candidate_layouts, layout_options

if TYPE_CHECKING:
    from lightning_parallel.planning.auto import Machine

# the analytic planner's elementwise work on the host: a core's share of a server's memory bandwidth (nominal, not
# fitted; on the host it enters only through ratios of a layout to itself, or for models planned by shape)
HOST_MEMORY_BANDWIDTH = 10e9


def machine_cluster(machine: Machine) -> Cluster:
    """The analytic planner's :class:`Cluster` for ``machine``: its GPU's row of the device table, with the memory
    found; on the host, a device of the host model's FLOP/s, bandwidth and latency per message (every kernel at
    that rate, elementwise work at :data:`HOST_MEMORY_BANDWIDTH`)."""
    if machine.device in DEVICES:
        device = replace(DEVICES[machine.device], memory=machine.device_memory)
    else:
        link = machine.bandwidth / COMM_EFFICIENCY  # what the collectives achieve is machine.bandwidth
        device = Device(
            machine.device or machine.kind,
            machine.device_flops,
            machine.device_memory,
            HOST_MEMORY_BANDWIDTH,
            link,
            link,
            gemm_efficiency=1.0,
            attention_efficiency=1.0,
            intra_latency=machine.latency,
            inter_latency=machine.latency,
        )
    return Cluster(machine.world_size, machine.node_size, device)


def analytic_candidates(shape: ModelShape, cluster: Cluster, work: Workload) -> list[AnalyticEstimate]:
    """Each split of the cluster (:func:`~lightning_parallel.planning.search.candidate_layouts`) at its fastest
    checkpointing, sequence parallelism, ZeRO stage, virtual stages and microbatches (pp=1: the whole dp batch at
    once, as the strategy runs it), or at its least memory when none fits."""
    out = []
    for base in candidate_layouts(shape, cluster, work):
        free = [f for f in SEARCHED if not (base.dp_shard and f == "zero_stage")] + ["sequence_parallel"]
        if base.pp == 1:
            base = replace(base, microbatches=1)
            free.remove("microbatches")
        out += best_of(shape, cluster, layout_options(base, work, tuple(free)), work)
    return out


def calibrated_variants(
    shape: ModelShape, est: Estimate, machine: Machine, settings: Settings
) -> list[tuple[Estimate, dict[str, Any]]]:
    """The profiled estimate ``est`` under each activation checkpointing mode and, at tp > 1, with sequence
    parallelism: its activations per rank and its step time times the analytic planner's ratio of the variant to
    the same layout without it. Each comes with the :class:`ParallelConfig` fields that set it.

    Args:
        shape: the profiled model's shape (``hf_config.from_recipe`` for the recipe GPTs).
        est: a profiled layout (any, also one over the memory: the variants may fit).
        machine: the job; settings: what ``est`` was estimated for.
    """
    work = Workload(
        shape.seq_len, settings.global_batch, settings.precision, optimizer_states=settings.optimizer_states
    )
    base = Layout(tp=est.tp, pp=est.pp, dp=est.dp, ep=est.ep, zero_stage=est.zero_stage or 0)
    base = replace(base, pp_schedule=settings.schedule, microbatches=est.microbatches)
    if est.zero_stage is None or layout_error(shape, base, work, machine.world_size, machine.node_size):
        return []
    cluster = machine_cluster(machine)
    plain = evaluate(shape, cluster, base, work)
    out = []
    for mode in CHECKPOINTING:
        for sp in (False, True) if est.tp > 1 else (False,):
            if mode == "none" and not sp:
                continue
            other = evaluate(shape, cluster, replace(base, activation_checkpointing=mode, sequence_parallel=sp), work)
            ratio = other.activations / plain.activations
            acts = [a * ratio for a in est.activation_per_rank]
            variant = replace(est, activation_per_rank=acts, reason="")
            variant.memory_per_rank = [s + a for s, a in zip(est.model_state_per_rank, acts)]
            variant.step_time = est.step_time * other.step_time / plain.step_time
            if variant.memory > settings.device_memory:
                variant.reason = f"out of memory: {variant.memory / 1e9:.2f} GB > {settings.device_memory / 1e9:.2f} GB"
            out.append((variant, {"activation_checkpointing": mode, "sequence_parallel": sp}))
    return out
