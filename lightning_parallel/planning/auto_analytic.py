"""``strategy=auto``'s use of the analytic planner (:mod:`.analytic`): the job's devices as a :class:`Cluster`, and
every axis searched for a model given by its shape (a Hugging Face config, a LitGPT name). Pure Python."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lightning_parallel.planning.analytic import AnalyticEstimate
from lightning_parallel.planning.cluster import COMM_EFFICIENCY, DEVICES, Cluster, Device
from lightning_parallel.planning.hf_config import ModelShape
from lightning_parallel.planning.layout import Workload
from lightning_parallel.planning.search import SEARCHED, Refusal, best_of, candidate_layouts, layout_options
from lightning_parallel.planning.timemodel import CALIBRATION, NOMINAL

if TYPE_CHECKING:
    from lightning_parallel.planning.auto import Machine

# the analytic planner's elementwise work on the host: a core's share of a server's memory bandwidth (nominal, not
# fitted: only models planned by their shape meet it on the host)
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
            fp8_flops=machine.device_flops,  # fp8 emulated on the host: no faster than the rest
        )
    return Cluster(
        machine.world_size, machine.node_size, device, NOMINAL if machine.device not in DEVICES else CALIBRATION
    )


def analytic_candidates(
    shape: ModelShape, cluster: Cluster, work: Workload, refuses: Refusal | None = None
) -> list[AnalyticEstimate]:
    """Each split of the cluster (:func:`~lightning_parallel.planning.search.candidate_layouts`) at its fastest
    checkpointing, sequence parallelism, ZeRO stage, virtual stages and microbatches (pp=1: the whole dp batch at
    once, as the strategy runs it), or at its least memory when none fits; none that ``refuses`` (the model
    family's checks, :mod:`lightning_parallel.recipes.family`) gives a reason for."""
    out = []
    for base in candidate_layouts(shape, cluster, work):
        free = [f for f in SEARCHED if not (base.dp_shard and f == "zero_stage")] + ["sequence_parallel"]
        if base.pp == 1:
            base = replace(base, microbatches=1)
            free.remove("microbatches")
        out += best_of(shape, cluster, layout_options(base, work, tuple(free)), work, refuses=refuses)
    return out
