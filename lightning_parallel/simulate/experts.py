"""Expert parallelism's token exchange with the routing simulated as uniform.

A real step learns on the host how many rows each rank sends to each other (``dispatch.exchange``: one
device-to-host copy of the routed counts, which ``all_to_all_single`` takes as host integers); fake tensors hold no
counts. Here every rank sends each expert the same share of its routed rows (a perfectly balanced router), so the
all-to-alls, the expert matmuls and their memory are those of a balanced step: a real router's imbalance makes the
busiest rank's rows, bytes and padded expert batches larger (docs/simulate.md). Everything else of the layer (the
router, the counts' own all-to-all, the combine) runs as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.expert import dispatch
from lightning_parallel.parallel.expert.dispatch import Compute, all_to_all, grouped_by_local_expert


def even_splits(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` as evenly as whole rows allow (the first ones one larger)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def uniform_exchange(x: Tensor, counts: Tensor, group: dist.ProcessGroup, compute: Compute) -> Tensor:
    """``dispatch.exchange`` with the split sizes of a uniform routing instead of the routed counts."""
    ranks = dist.get_world_size(group)
    local_experts = counts.numel() // ranks
    recv_counts = counts.new_empty(counts.shape)
    dist.all_to_all_single(recv_counts, counts, group=group)  # issued as in a real step
    splits = even_splits(x.shape[0], ranks)  # every rank routes as many rows: what it sends it also receives
    received = all_to_all(x, splits, splits, group)
    perm, local_counts = grouped_by_local_expert(recv_counts.view(ranks, local_experts), sum(splits))
    largest = max(even_splits(sum(splits), local_experts), default=0)
    out = compute(received[perm], local_counts, largest)
    return all_to_all(out[perm.argsort()], splits, splits, group)


@contextmanager
def uniform_routing() -> Iterator[None]:
    """Within: every MoE layer's exchange routes uniformly (:func:`uniform_exchange`)."""
    original = dispatch.exchange
    dispatch.exchange = uniform_exchange
    try:
        yield
    finally:
        dispatch.exchange = original
