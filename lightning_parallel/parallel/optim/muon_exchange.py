"""Each Muon matrix orthogonalized once, whole, on one owner rank of the group that shards it. Pure torch.

A matrix that is a DTensor split on one mesh dimension by ``Shard(d)`` (ZeRO-3's ``Shard(0)`` over the
data-parallel ranks, tensor parallelism's ``Shard(0)`` or ``Shard(1)``) belongs to the group of that mesh dimension.
The matrices of one group get owners there, largest first, each to the rank with the fewest elements so far
(balanced work). One ``all_to_all_single`` sends every rank's slice of each matrix, cast to ``ns_dtype``, to its
owner; each owner concatenates its matrices' slices, runs Newton-Schulz on the whole matrix, and a second
``all_to_all_single`` sends each rank its slices back. Casting before the wire is exact: the iteration starts by
casting to ``ns_dtype`` anyway, and its result is in ``ns_dtype``.

Bytes one rank sends per step, over a group of ``W`` ranks, with ``s_m = |m| / W`` its slice of matrix ``m``
(``b``: ``ns_dtype``'s element size)::

    sent = b * ( sum_{m not owned} s_m  +  sum_{m owned} (|m| - s_m) )  ~=  2 b (W - 1) P / W**2

for ``P`` elements of Muon matrices in the group, balanced owners and even slices: ``2/W`` of one all-gather of
them; an all-gather to every rank (each rank orthogonalizing every matrix) would send ``b (W - 1) P / W``.

ZeRO-1/2 (:class:`FlatMatrices`, :func:`orthogonalize_flat`): the matrices packed in a flat buffer whose equal slices
cut them anywhere; each matrix's contiguous segments go to its owner the same way, joined and reshaped there.

A matrix split on several mesh dimensions (ZeRO-3 x tp: ``Shard(0)`` and ``_StridedShard``) is gathered whole on
every rank of its mesh (``full_tensor``) and orthogonalized there (redundantly); a plain tensor or a replicated
DTensor is whole already and orthogonalized where it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def chunk_sizes(length: int, world: int) -> list[int]:
    """The lengths ``torch.chunk`` (and so ``Shard``) gives each of ``world`` ranks along a dimension of ``length``."""
    step = -(-length // world)
    return [max(0, min(step, length - rank * step)) for rank in range(world)]


def owners(numels: list[int], world: int) -> list[int]:
    """Each matrix's owner rank: largest first, each to the least-loaded rank (the lowest on a tie)."""
    load = [0] * world
    owner = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: -numels[i]):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += numels[index]
    return owner


def _single_shard(p: Tensor) -> tuple[int, int] | None:
    """(mesh dim, tensor dim) when ``p`` is split on exactly one mesh dimension by a plain ``Shard``."""
    split = [(i, pl) for i, pl in enumerate(p.placements) if not pl.is_replicate()]  # type: ignore[attr-defined]
    if len(split) == 1 and type(split[0][1]) is Shard:
        return split[0][0], split[0][1].dim
    return None


def orthogonalize_all(
    params: list[Tensor],
    updates: list[Tensor],
    orthogonalize: Callable[[Tensor], Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int] | None = None,
) -> list[Tensor]:
    """``orthogonalize`` applied to each whole matrix; returns each parameter's local piece of the result.

    ``updates``: each parameter's local momentum update. ``stats`` (optional) gets the elements and bytes this rank
    sent and the matrices it orthogonalized.
    """
    stats = stats if stats is not None else {}
    result: list[Tensor | None] = [None] * len(params)
    exchanged: dict[int, tuple[dist.ProcessGroup, list[tuple[int, int]]]] = {}
    for i, (p, update) in enumerate(zip(params, updates)):
        if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements):
            result[i] = orthogonalize(update)
            stats["orthogonalized"] = stats.get("orthogonalized", 0) + 1
            continue
        single = _single_shard(p)
        if single is None:
            whole = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            done = orthogonalize(whole.full_tensor())
            result[i] = distribute_tensor(done, p.device_mesh, p.placements, src_data_rank=None).to_local()
            stats["orthogonalized"] = stats.get("orthogonalized", 0) + 1
            continue
        group = p.device_mesh.get_group(single[0])
        exchanged.setdefault(id(group), (group, []))[1].append((i, single[1]))
    for group, members in exchanged.values():
        pieces = _exchange(group, [params[i] for i, _ in members], [updates[i] for i, _ in members],
                           [d for _, d in members], orthogonalize, wire_dtype, stats)  # fmt: skip
        for (i, _), piece in zip(members, pieces):
            result[i] = piece
    return result  # type: ignore[return-value]


def _exchange(
    group: dist.ProcessGroup,
    params: list[Tensor],
    updates: list[Tensor],
    dims: list[int],
    orthogonalize: Callable[[Tensor], Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
) -> list[Tensor]:
    """The DTensor matrices of one group, each split by ``Shard(dims[m])``: slices along that dimension."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shapes = []  # shapes[m][q]: matrix m's slice on rank q
    for p, d in zip(params, dims):
        shape = list(p.shape)
        shapes.append([tuple(shape[:d] + [n] + shape[d + 1 :]) for n in chunk_sizes(shape[d], world)])

    def assemble(m: int, pieces: list[Tensor]) -> Tensor:
        return torch.cat([piece.view(shapes[m][q]) for q, piece in enumerate(pieces)], dim=dims[m])

    def cut(m: int, whole: Tensor) -> list[Tensor]:
        return [piece.reshape(-1) for piece in whole.split([s[dims[m]] for s in shapes[m]], dim=dims[m])]

    numels = [[_prod(s) for s in per_rank] for per_rank in shapes]
    flat = [u.reshape(-1) for u in updates]
    done = owner_exchange(group, numels, flat, assemble, cut, orthogonalize, wire_dtype, stats)
    return [piece.view(shapes[m][rank]) for m, piece in enumerate(done)]


@dataclass
class FlatMatrices:
    """ZeRO-1/2: the matrices packed in one flat buffer sharded over ``group``, rank ``q`` holding elements
    ``[q * shard_numel, (q + 1) * shard_numel)``: each matrix's offset and (whole) shape."""

    group: dist.ProcessGroup
    shard_numel: int
    offsets: list[int]
    shapes: list[torch.Size]

    def segments(self, m: int, world: int) -> list[tuple[int, int]]:
        """Matrix ``m``'s elements on each rank: (start, end) in the flat buffer (end <= start: none)."""
        lo, hi = self.offsets[m], self.offsets[m] + _prod(tuple(self.shapes[m]))
        return [(max(lo, q * self.shard_numel), min(hi, (q + 1) * self.shard_numel)) for q in range(world)]


def orthogonalize_flat(
    layout: FlatMatrices,
    update: Tensor,
    orthogonalize: Callable[[Tensor], Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
) -> list[tuple[int, int, int, Tensor]]:
    """ZeRO-1/2: ``update`` is this rank's slice of the flat buffer; each matrix's segments go to its owner, are
    joined (they are contiguous in the buffer) and orthogonalized there, and come back. Returns (matrix, start, end,
    piece) per matrix with elements here, positions relative to this rank's slice."""
    world, rank = dist.get_world_size(layout.group), dist.get_rank(layout.group)
    segments = [layout.segments(m, world) for m in range(len(layout.shapes))]
    numels = [[max(0, hi - lo) for lo, hi in seg] for seg in segments]
    base = rank * layout.shard_numel
    mine = [update[max(0, lo - base) : max(0, hi - base)] if hi > lo else update[:0] for lo, hi in
            (seg[rank] for seg in segments)]  # fmt: skip

    def assemble(m: int, pieces: list[Tensor]) -> Tensor:
        return torch.cat(pieces).view(layout.shapes[m])

    def cut(m: int, whole: Tensor) -> list[Tensor]:
        return list(whole.reshape(-1).split(numels[m]))

    done = owner_exchange(layout.group, numels, mine, assemble, cut, orthogonalize, wire_dtype, stats)
    here = [seg[rank] for seg in segments]
    return [(m, lo - base, hi - base, piece) for m, ((lo, hi), piece) in enumerate(zip(here, done)) if hi > lo]


def owner_exchange(
    group: dist.ProcessGroup,
    numels: list[list[int]],
    mine: list[Tensor],
    assemble: Callable[[int, list[Tensor]], Tensor],
    cut: Callable[[int, Tensor], list[Tensor]],
    orthogonalize: Callable[[Tensor], Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
) -> list[Tensor]:
    """Matrices split over ``group`` (``numels[m][q]``: matrix m's elements on rank q; ``mine[m]``: this rank's,
    flat): each to its owner by one ``all_to_all_single``, joined by ``assemble``, orthogonalized, cut into the
    ranks' flat pieces by ``cut``, and back by a second one. Returns this rank's flat piece of each result."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = len(numels)
    owner = owners([sum(n) for n in numels], world)
    owned = [m for m in range(count) if owner[m] == rank]
    empty = mine[0].new_empty(0, dtype=wire_dtype)
    send = [torch.cat([mine[m].to(wire_dtype) for m in range(count) if owner[m] == q] or [empty]) for q in range(world)]
    in_splits = [t.numel() for t in send]
    out_splits = [sum(numels[m][q] for m in owned) for q in range(world)]
    received = _all_to_all(torch.cat(send), in_splits, out_splits, group)
    by_rank = [chunk.split([numels[m][q] for m in owned]) for q, chunk in enumerate(received.split(out_splits))]
    back: list[list[Tensor]] = [[] for _ in range(world)]
    for k, m in enumerate(owned):
        for q, piece in enumerate(cut(m, orthogonalize(assemble(m, [by_rank[q][k] for q in range(world)])))):
            back[q].append(piece)
    back_flat = [torch.cat(pieces).to(wire_dtype) if pieces else empty for pieces in back]
    in_back = [t.numel() for t in back_flat]
    out_back = [sum(numels[m][rank] for m in range(count) if owner[m] == q) for q in range(world)]
    returned = _all_to_all(torch.cat(back_flat), in_back, out_back, group)
    from_owner = [iter(chunk.split([numels[m][rank] for m in range(count) if owner[m] == q]))
                  for q, chunk in enumerate(returned.split(out_back))]  # fmt: skip
    result = [next(from_owner[owner[m]]) for m in range(count)]
    elements = sum(n for q, n in enumerate(in_splits) if q != rank) + sum(n for q, n in enumerate(in_back) if q != rank)
    stats["sent_elements"] = stats.get("sent_elements", 0) + elements
    stats["sent_bytes"] = stats.get("sent_bytes", 0) + elements * torch.finfo(wire_dtype).bits // 8
    stats["orthogonalized"] = stats.get("orthogonalized", 0) + len(owned)
    return result


def _all_to_all(flat: Tensor, in_splits: list[int], out_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    out = flat.new_empty(sum(out_splits))
    dist.all_to_all_single(out, flat.contiguous(), out_splits, in_splits, group=group)
    return out


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
