"""A step-time estimate from what one simulated rank did, on the planner's calibrated time model
(:mod:`lightning_parallel.planning.timemodel`, the constants fitted on published runs): its counted FLOPs at the
device's achieved-FLOP efficiency, its recorded collectives over the link model (each group inside a node or across
nodes from the rank placement, :mod:`lightning_parallel.planning.cluster`), the pipeline bubble from the schedule
table, and the overlap rule: tp, cp, ep and pipeline transfers on the critical path; data-parallel gathers and
reductions hidden behind at most the calibrated fraction of the compute (:func:`~.timemodel.exposed_dp`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_parallel.planning.cluster import Cluster
from lightning_parallel.planning.timemodel import exposed_dp
from lightning_parallel.simulate.trace import Collective

GATHER_LIKE = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "broadcast", "reduce")
DATA_AXES = frozenset(("dpr", "dp", "ep", "cp"))  # the axes ZeRO shards and reduces over (flattened: dp_cp, ...)
DATA_OPS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step on one rank.

    Attributes:
        compute: counted FLOPs / (peak x the device's calibrated GEMM efficiency x ``achieved``).
        bubble: the pipeline's idle fraction of the step (0 without pp).
        comm: the recorded collectives over the link model, by mesh axes (before overlap).
        exposed: the part of ``comm`` on the critical path (tp, cp, ep, pp, and what of the data-parallel
            collectives the overlap rule leaves).
        total: compute / (1 - bubble) + exposed.
        mfu: counted FLOPs / (total x peak): what this rank's device does of its peak (with activation
            checkpointing the recomputed forward counts: then it is HFU, hardware FLOPs utilization).
    """

    compute: float
    bubble: float
    comm: dict[str, float]
    exposed: float
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


def is_data_parallel(c: Collective) -> bool:
    """A gather or reduction over data-parallel axes only (ZeRO's, FSDP's): what may overlap with compute."""
    return c.op in DATA_OPS and set(c.axes.split("_")) <= DATA_AXES


def step_time(
    flops: float,
    ops: Iterable[Collective],
    cluster: Cluster,
    bubble: float = 0.0,
    zero3: bool = False,
    hide_reduce: bool = False,
) -> StepTime:
    """:class:`StepTime` of a rank that computed ``flops`` and issued ``ops`` in one step.

    Args:
        zero3: the data-parallel all-gathers are ZeRO-3's parameter gathers (prefetched behind compute); else
            they gather updated parameters after the step and count with the reduction.
        hide_reduce: the gradient reduction overlaps the backward (ZeRO-3, ``overlap_grad_reduce``).
    """
    device = cluster.device
    compute = flops / (device.peak_flops * cluster.efficiency("gemm") * cluster.calibration.achieved)
    comm: dict[str, float] = {}
    critical = reduce = gathers = 0.0
    for c in ops:
        seconds = collective_seconds(c, cluster) * c.count
        comm[c.axes] = comm.get(c.axes, 0.0) + seconds
        if not is_data_parallel(c):
            critical += seconds
        elif zero3 and c.op == "all_gather":
            gathers += seconds
        else:
            reduce += seconds
    exposed = critical + exposed_dp(reduce, gathers, compute, cluster.calibration.overlap, hide_reduce or zero3)
    total = compute / (1.0 - bubble) + exposed
    mfu = flops / (total * device.peak_flops) if total > 0 else 0.0
    return StepTime(compute, bubble, comm, exposed, total, mfu)
