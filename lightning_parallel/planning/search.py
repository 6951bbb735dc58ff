"""The analytic planner's search: every valid layout of a cluster (degrees, ZeRO stage, HSDP, microbatches,
virtual stages, checkpointing), each estimated by :func:`.analytic.evaluate`, fastest first. Pure Python."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace

from lightning_parallel.parallel.data.stages import planned_stages
from lightning_parallel.planning.analytic import AnalyticEstimate, evaluate
from lightning_parallel.planning.cluster import Cluster
from lightning_parallel.planning.hf_config import ModelShape
from lightning_parallel.planning.layout import CHECKPOINTING, Layout, Workload, layout_error


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def layout_options(layout: Layout, work: Workload, free: tuple[str, ...]) -> Iterator[Layout]:
    """``layout`` with each field in ``free`` set to each value worth trying: microbatch sizes 1-8 (as a count),
    1-8 virtual stages (interleaved), the checkpointing choices, ZeRO stages and overlap."""
    per_dp = max(1, work.global_batch // layout.dp)
    values: dict[str, list] = {
        "microbatches": sorted({per_dp // b for b in (1, 2, 4, 8) if per_dp % b == 0}),
        "pp_virtual_stages": [None, 2, 4, 8] if layout.pp_schedule == "interleaved_1f1b" else [None],
        "activation_checkpointing": list(CHECKPOINTING),
        # ZeRO-1 moves what ZeRO-2 moves and holds more; registered variants by name (planned_stages)
        "zero_stage": [0, 2, 3, *(s for s in planned_stages() if hasattr(s, "sharding"))],
        "overlap_grad_reduce": [True],
        # on where tp splits: the faster, and off for the models that refuse it with pp (the search's refusal)
        "sequence_parallel": [True, False] if layout.tp > 1 else [False],
    }
    names = [f for f in free if f in values]
    for combo in itertools.product(*(values[f] for f in names)):
        yield replace(layout, **dict(zip(names, combo)))


# why the model's family refuses a layout ("" if it takes it): what its module checks before launch
Refusal = Callable[[Layout], str]


def best_of(
    shape: ModelShape,
    cluster: Cluster,
    candidates: Iterator[Layout],
    work: Workload,
    top: int = 1,
    refuses: Refusal | None = None,
) -> list[AnalyticEstimate]:
    """The ``top`` fastest of ``candidates`` that fit (or, if none fits, the least memory-hungry valid ones),
    leaving out what ``refuses`` names a reason for."""
    fits, over = [], []
    for layout in candidates:
        if layout_error(shape, layout, work, cluster.gpus, cluster.gpus_per_node) or (refuses and refuses(layout)):
            continue
        est = evaluate(shape, cluster, layout, work)
        (fits if est.feasible else over).append(est)
    if fits:
        return sorted(fits, key=lambda e: (e.step_time, e.memory))[:top]
    return sorted(over, key=lambda e: e.memory)[:top]


def complete(
    shape: ModelShape,
    cluster: Cluster,
    layout: Layout,
    work: Workload,
    free: tuple[str, ...],
    refuses: Refusal | None = None,
) -> AnalyticEstimate | None:
    """The best estimate of ``layout`` over the fields it leaves ``free`` (None: no valid completion)."""
    best = best_of(shape, cluster, layout_options(layout, work, free), work, refuses=refuses)
    return best[0] if best else None


SEARCHED = ("microbatches", "pp_virtual_stages", "activation_checkpointing", "zero_stage", "overlap_grad_reduce")


def candidate_layouts(shape: ModelShape, cluster: Cluster, work: Workload) -> Iterator[Layout]:
    """Every split of the cluster into tp (within a node), cp, pp, dp and ep, with HSDP over whole nodes."""
    n, g = cluster.gpus, cluster.gpus_per_node
    for tp in _powers_of_two(g):
        for cp in [c for c in _powers_of_two(n // tp) if work.seq_len // c >= 2048 or c == 1]:
            for pp in divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                if pp > shape.layers or work.global_batch % dp:
                    continue
                schedule = "interleaved_1f1b" if pp > 1 else "1f1b"
                for ep in [e for e in divisors(dp) if shape.experts % e == 0] if shape.experts else [1]:
                    base = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, pp_schedule=schedule)
                    yield from _with_sharding(base, tp * cp, g)


def _with_sharding(base: Layout, inner: int, per_node: int) -> Iterator[Layout]:
    yield base
    shard = per_node // inner if per_node > inner else 0  # HSDP: shard within a node, replicate across nodes
    if shard > 1 and base.dp > shard and base.dp % shard == 0:
        for stage in (1, 2, 3):
            yield replace(base, dp_shard=shard, zero_stage=stage)


def search(
    shape: ModelShape, cluster: Cluster, work: Workload, top: int = 5, refuses: Refusal | None = None
) -> list[AnalyticEstimate]:
    """The ``top`` fastest layouts that fit, each with its best microbatches, virtual stages, checkpointing and
    ZeRO stage (HSDP layouts keep their stage); none that ``refuses`` (the model family's checks) refuses."""
    best: list[AnalyticEstimate] = []
    for base in candidate_layouts(shape, cluster, work):
        free = tuple(f for f in SEARCHED if not (base.dp_shard and f == "zero_stage")) + ("sequence_parallel",)
        best += best_of(shape, cluster, layout_options(base, work, free), work, refuses=refuses)
    fits = [e for e in best if e.feasible]
    return sorted(fits, key=lambda e: (e.step_time, e.memory))[:top]
