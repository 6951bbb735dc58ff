"""Muon's owners and the two ``all_to_all_single`` that gather each matrix's pieces to its owner and send the
result's pieces back (:mod:`.muon_exchange` uses them on one group, :mod:`.muon_mesh` on two in turn). Pure torch."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor


def chunk_sizes(length: int, world: int) -> list[int]:
    """The lengths ``torch.chunk`` (and so ``Shard``) gives each of ``world`` ranks along a dimension of ``length``."""
    step = -(-length // world)
    return [max(0, min(step, length - rank * step)) for rank in range(world)]


def ns_cost(shape: tuple[int, ...]) -> int:
    """Newton-Schulz's work on a (n, m) matrix, up to a constant: ``n * m * min(n, m)`` per iteration (its three
    matmuls are each that, times a small factor); a stack (E, n, m) of expert matrices is E of them."""
    *stack, n, m = shape
    return prod(tuple(stack)) * n * m * min(n, m)


def owners(costs: list[int], world: int) -> list[int]:
    """Each matrix's owner rank: costliest first (``ns_cost``), each to the least-loaded rank (the lowest on a tie)."""
    load = [0] * world
    owner = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += costs[index]
    return owner


def count_done(stats: dict[str, int], whole: Tensor) -> None:
    """``stats``: one more Newton-Schulz on ``whole`` here (a stack (E, n, m): E matrices) and its cost."""
    stats["orthogonalized"] = stats.get("orthogonalized", 0) + (whole.shape[0] if whole.ndim == 3 else 1)
    stats["ns_cost"] = stats.get("ns_cost", 0) + ns_cost(tuple(whole.shape))


def count_sent(stats: dict[str, int], elements: int, wire_dtype: torch.dtype) -> None:
    stats["sent_elements"] = stats.get("sent_elements", 0) + elements
    stats["sent_bytes"] = stats.get("sent_bytes", 0) + elements * torch.finfo(wire_dtype).bits // 8


def gather_to_owners(
    group: dist.ProcessGroup,
    numels: list[list[int]],
    owner: list[int],
    mine: list[Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
    device: torch.device | None = None,
) -> dict[int, list[Tensor]]:
    """One ``all_to_all_single``: every rank's flat piece of matrix m (``numels[m][q]`` elements on rank q,
    ``mine[m]`` here) to ``owner[m]``. Returns, for each matrix this rank owns, its pieces in rank order."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    owned = [m for m in range(len(numels)) if owner[m] == rank]
    empty = torch.empty(0, dtype=wire_dtype, device=mine[0].device if mine else device)
    send = [torch.cat([mine[m].reshape(-1).to(wire_dtype) for m in range(len(numels)) if owner[m] == q] or [empty])
            for q in range(world)]  # fmt: skip
    in_splits = [t.numel() for t in send]
    out_splits = [sum(numels[m][q] for m in owned) for q in range(world)]
    received = all_to_all(torch.cat(send), in_splits, out_splits, group)
    by_rank = [chunk.split([numels[m][q] for m in owned]) for q, chunk in enumerate(received.split(out_splits))]
    count_sent(stats, sum(n for q, n in enumerate(in_splits) if q != rank), wire_dtype)
    return {m: [by_rank[q][k] for q in range(world)] for k, m in enumerate(owned)}


def scatter_from_owners(
    group: dist.ProcessGroup,
    numels: list[list[int]],
    owner: list[int],
    pieces: dict[int, list[Tensor]],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
    device: torch.device | None = None,
) -> list[Tensor]:
    """The way back: ``pieces[m][q]`` (for each matrix m this rank owns) to rank q. Returns this rank's flat piece
    of every matrix."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = len(numels)
    empty = torch.empty(0, dtype=wire_dtype, device=device)
    back = [torch.cat([pieces[m][q].reshape(-1).to(wire_dtype) for m in sorted(pieces)] or [empty])
            for q in range(world)]  # fmt: skip
    in_back = [t.numel() for t in back]
    out_back = [sum(numels[m][rank] for m in range(count) if owner[m] == q) for q in range(world)]
    returned = all_to_all(torch.cat(back), in_back, out_back, group)
    from_owner = [iter(chunk.split([numels[m][rank] for m in range(count) if owner[m] == q]))
                  for q, chunk in enumerate(returned.split(out_back))]  # fmt: skip
    count_sent(stats, sum(n for q, n in enumerate(in_back) if q != rank), wire_dtype)
    return [next(from_owner[owner[m]]) for m in range(count)]


def owner_exchange(
    group: dist.ProcessGroup,
    numels: list[list[int]],
    costs: list[int],
    mine: list[Tensor],
    assemble: Callable[[int, list[Tensor]], Tensor],
    cut: Callable[[int, Tensor], list[Tensor]],
    orthogonalize: Callable[[Tensor], Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
    owner: list[int] | None = None,
) -> list[Tensor]:
    """Matrices split over ``group`` (``numels[m][q]``: matrix m's elements on rank q; ``mine[m]``: this rank's,
    flat): each to its owner (``owner``, or balanced by ``costs``), joined by ``assemble``, orthogonalized, cut into
    the ranks' flat pieces by ``cut``, and back. Returns this rank's flat piece of each result."""
    owner = owner if owner is not None else owners(costs, dist.get_world_size(group))
    gathered = gather_to_owners(group, numels, owner, mine, wire_dtype, stats)
    done = {}
    for m, pieces in gathered.items():
        whole = assemble(m, pieces)
        count_done(stats, whole)
        done[m] = cut(m, orthogonalize(whole))
    device = mine[0].device if mine else None
    return scatter_from_owners(group, numels, owner, done, wire_dtype, stats, device)


def all_to_all(flat: Tensor, in_splits: list[int], out_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    out = flat.new_empty(sum(out_splits))
    dist.all_to_all_single(out, flat.contiguous(), out_splits, in_splits, group=group)
    return out


def prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
