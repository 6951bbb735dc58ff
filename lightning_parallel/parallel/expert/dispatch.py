"""Tokens to their experts and back: the permutation by expert, and the all-to-all over the expert-parallel ranks.
Pure torch.

Every (token, choice) pair the router kept is sorted by expert; with expert parallelism the rows for the experts of
rank r go to rank r with one ``all_to_all_single`` (uneven splits: the per-expert counts are exchanged first), are
grouped there by local expert for one grouped matmul, and come back the same way. The all-to-all's backward is the
all-to-all with the splits swapped, so each expert's gradient sums the contributions of every rank's tokens.

Host syncs: none without expert parallelism (dropless; a capacity mask's kept count is read once); with it, one
copy of the counts per layer and forward, for the split sizes ``all_to_all_single`` takes as host ints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

# (rows grouped by local expert, rows per local expert, the largest of those counts as a host int) -> outputs
Compute = Callable[[Tensor, Tensor, int], Tensor]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Rows ``in_splits[r]`` of ``x`` to rank r; returns the rows every rank sent here (``out_splits[r]`` from r)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class Routed:
    """The kept (token, choice) pairs of one forward, sorted by expert."""

    token: Tensor  # (M,) the token of each pair
    weight: Tensor  # (M,) its combine weight (differentiable)
    expert: Tensor  # (M,) its expert, ascending


def sort_by_expert(expert_ids: Tensor, weights: Tensor, keep: Tensor | None) -> Routed:
    """``expert_ids``, ``weights``, ``keep``: (N, k). Pairs in expert order, tokens in order within an expert.
    ``keep`` None (dropless) keeps every pair and costs no host sync; a mask's kept count is read on the host."""
    k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)
    if keep is None:
        pairs = torch.argsort(flat_ids, stable=True)
    else:
        kept = keep.reshape(-1).nonzero().squeeze(1)
        pairs = kept[torch.argsort(flat_ids[kept], stable=True)]
    return Routed(pairs // k, weights.reshape(-1)[pairs], flat_ids[pairs])


def count_per_expert(sorted_experts: Tensor, num_experts: int) -> Tensor:
    """(E,) rows per expert of ascending expert ids, on their device (``bincount`` would read its size on the host
    on CUDA)."""
    experts = torch.arange(num_experts, device=sorted_experts.device, dtype=sorted_experts.dtype)
    ends = torch.searchsorted(sorted_experts, experts, right=True)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def grouped_by_local_expert(recv_counts: Tensor, total: int | None = None) -> tuple[Tensor, Tensor]:
    """Rows received from P ranks, each block in local-expert order (``recv_counts``: (P, E_local)): the
    permutation that groups them by local expert (sources in rank order within an expert), and the counts.
    ``total`` (the rows received, when known on the host) spares ``repeat_interleave`` a host sync."""
    sources, local_experts = recv_counts.shape
    expert_of_row = torch.arange(local_experts, device=recv_counts.device).repeat(sources)
    expert_of_row = torch.repeat_interleave(expert_of_row, recv_counts.reshape(-1), output_size=total)
    return torch.argsort(expert_of_row, stable=True), recv_counts.sum(0)


def exchange(x: Tensor, counts: Tensor, group: dist.ProcessGroup, compute: Compute) -> Tensor:
    """Send the rows of ``x`` (sorted by global expert, ``counts`` per expert) to the ranks holding their experts,
    run ``compute(rows, local_counts, largest_local_count)`` there on rows grouped by local expert, and bring the
    results back in the order of ``x``."""
    ranks = dist.get_world_size(group)
    local_experts = counts.numel() // ranks
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # how many rows of each local expert come from each rank
    # The layer's one device->host copy: all_to_all_single takes its split sizes as host ints. Everything else the
    # host needs (the rows received, the padded kernel's width) comes from this same copy.
    sent, got = torch.stack([counts, recv_counts]).tolist()
    send_splits = [sum(sent[r * local_experts : (r + 1) * local_experts]) for r in range(ranks)]
    recv_splits = [sum(got[r * local_experts : (r + 1) * local_experts]) for r in range(ranks)]
    largest = max((sum(got[e::local_experts]) for e in range(local_experts)), default=0)
    received = all_to_all(x, recv_splits, send_splits, group)
    perm, local_counts = grouped_by_local_expert(recv_counts.view(ranks, local_experts), sum(recv_splits))
    out = compute(received[perm], local_counts, largest)
    back = out[torch.argsort(perm)]
    return all_to_all(back, send_splits, recv_splits, group)


def dispatch(
    tokens: Tensor,
    expert_ids: Tensor,
    weights: Tensor,
    num_experts: int,
    compute: Compute,
    group: dist.ProcessGroup | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Every token through its routed experts, the outputs mixed by the routing weights: (N, d) out, and the (E,)
    kept choices per expert.

    Args:
        tokens: (N, d).
        expert_ids, weights: (N, k) the router's choices and their combine weights (differentiable).
        num_experts: E, over every rank.
        compute: the experts this rank holds, on rows grouped by local expert (``Compute``).
        group: the expert-parallel ranks, each holding E / ep experts (None or one rank: every expert here).
        keep: (N, k) the choices a capacity kept (None: dropless).
    """
    routed = sort_by_expert(expert_ids, weights, keep)
    counts = count_per_expert(routed.expert, num_experts)
    rows = tokens[routed.token]
    if group is not None and dist.get_world_size(group) > 1:
        out_rows = exchange(rows, counts, group, compute)
    else:
        out_rows = compute(rows, counts, None)
    mixed = out_rows * routed.weight.unsqueeze(-1).to(out_rows.dtype)
    out = torch.zeros_like(tokens, dtype=mixed.dtype).index_add(0, routed.token, mixed).to(tokens.dtype)
    return out, counts
