"""A step-time estimate from what one simulated rank did: its counted FLOPs at the planner's device efficiency,
its recorded collectives over the planner's link model (:mod:`lightning_parallel.planning.cluster`), the pipeline
bubble from the schedule table; and the MFU that follows.

No overlap is assumed (compute, then every collective, as the profiling planner's estimate): an upper bound on
the step when FSDP2's prefetch or overlapped gradient reduction hide communication behind compute.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_parallel.planning.cluster import Cluster
from lightning_parallel.simulate.trace import Collective

GATHER_LIKE = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "broadcast", "reduce")


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step on one rank.

    Attributes:
        compute: counted FLOPs / (peak x the device's GEMM efficiency).
        bubble: the pipeline's idle fraction of the step (0 without pp).
        comm: the recorded collectives over the link model, by mesh axes.
        total: compute / (1 - bubble) + all of comm.
        mfu: counted FLOPs / (total x peak): what this rank's device does of its peak (with activation
            checkpointing the recomputed forward counts: then it is HFU, hardware FLOPs utilization).
    """

    compute: float
    bubble: float
    comm: dict[str, float]
    total: float
    mfu: float


def collective_seconds(c: Collective, cluster: Cluster) -> float:
    """The link model's seconds for one op (a receive costs nothing: its sender pays the transfer)."""
    if c.group_size <= 1 or c.op == "recv":
        return 0.0
    if c.op == "all_reduce":
        return cluster.all_reduce_time(c.payload_bytes, c.stride, c.group_size)
    if c.op == "send":
        return c.payload_bytes / cluster.bandwidth(c.stride, 2) + cluster.latency(c.stride, 2)
    return cluster.gather_time(c.payload_bytes, c.stride, c.group_size)


def step_time(flops: float, ops: Iterable[Collective], cluster: Cluster, bubble: float = 0.0) -> StepTime:
    """:class:`StepTime` of a rank that computed ``flops`` and issued ``ops`` in one step."""
    device = cluster.device
    compute = flops / (device.peak_flops * device.gemm_efficiency)
    comm: dict[str, float] = {}
    for c in ops:
        comm[c.axes] = comm.get(c.axes, 0.0) + collective_seconds(c, cluster)
    total = compute / (1.0 - bubble) + sum(comm.values())
    mfu = flops / (total * device.peak_flops) if total > 0 else 0.0
    return StepTime(compute, bubble, comm, total, mfu)
