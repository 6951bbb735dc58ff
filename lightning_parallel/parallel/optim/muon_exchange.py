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

HSDP (split over the shard group, replicated over the replicas: :func:`exchange_replicas`): owners over replicas x
shards. dp x tp with ZeRO-3 (split on two mesh dimensions): owners over both (:mod:`.muon_mesh`); any other split on
several mesh dimensions is gathered whole on every rank of its mesh (``full_tensor``) and orthogonalized there.
Whole matrices held alike by several ranks (ZeRO-0's plain tensors over its dp group, a DTensor replicated over a
1-D mesh) get one owner there (:func:`replicated_exchange`); ep's experts are orthogonalized where they live.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_parallel.parallel.optim.muon_mesh import exchange_two_axes, two_axes
from lightning_parallel.parallel.optim.muon_owners import (
    all_to_all,
    chunk_sizes,
    count_done,
    count_sent,
    ns_cost,
    owner_exchange,
    owners,
    prod,
)


def _experts_whole(p: DTensor) -> bool:
    """A stack (E, n, m) split on the expert dimension only (ep, or ZeRO-3 on dim 0): each local expert is whole."""
    return p.ndim == 3 and all(pl.is_replicate() or getattr(pl, "dim", None) == 0 for pl in p.placements)


def _replicated_dim(p: DTensor, shard_dim: int) -> int | None:
    """HSDP's replicate dimension: a 2-D mesh whose other dimension (of more than one rank) replicates ``p``."""
    mesh = p.device_mesh
    if mesh.ndim != 2 or not p.placements[1 - shard_dim].is_replicate() or mesh.size(1 - shard_dim) == 1:
        return None
    return 1 - shard_dim


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
    replica_group: dist.ProcessGroup | None = None,
) -> list[Tensor]:
    """``orthogonalize`` applied to each whole matrix (a 3-D stack: to each of its experts); returns each
    parameter's local piece of the result.

    ``updates``: each parameter's local momentum update. ``stats`` (optional) gets the elements and bytes this rank
    sent, the matrices it orthogonalized and their cost (``ns_cost``). ``replica_group``: the ranks that hold the
    same whole matrices (ZeRO-0's data-parallel group): each whole matrix is then orthogonalized by one owner there
    and sent to the others (:func:`replicated_exchange`), not on every rank.
    """
    stats = stats if stats is not None else {}
    result: list[Tensor | None] = [None] * len(params)
    exchanged: dict[int, tuple[dist.ProcessGroup, list[tuple[int, int]]]] = {}
    meshes: dict[tuple, tuple[DeviceMesh, list[tuple[int, int]]]] = {}
    hsdp: dict[tuple, tuple[DeviceMesh, int, list[tuple[int, int]]]] = {}
    whole: list[int] = []
    for i, (p, update) in enumerate(zip(params, updates)):
        if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements) or _experts_whole(p):
            whole.append(i)
            continue
        single = _single_shard(p)
        d = two_axes(p) if single is None else None
        if d is not None:  # dp x tp (ZeRO-3): owners over both axes (muon_mesh.py)
            # keyed by the ranks and axes: FSDP2 may give each parameter its own mesh object
            key = (tuple(p.device_mesh.mesh.flatten().tolist()), p.device_mesh.mesh_dim_names)
            meshes.setdefault(key, (p.device_mesh, []))[1].append((i, d))
            continue
        if single is None:
            full = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            done = orthogonalize(full.full_tensor())
            count_done(stats, done)
            result[i] = distribute_tensor(done, p.device_mesh, p.placements, src_data_rank=None).to_local()
            continue
        if _replicated_dim(p, single[0]) is not None:  # HSDP: owners over the replicas too
            key = (tuple(p.device_mesh.mesh.flatten().tolist()), p.device_mesh.mesh_dim_names, single[0])
            hsdp.setdefault(key, (p.device_mesh, single[0], []))[2].append((i, single[1]))
            continue
        group = p.device_mesh.get_group(single[0])
        exchanged.setdefault(id(group), (group, []))[1].append((i, single[1]))
    # whole matrices held alike by several ranks: a plain tensor by ZeRO-0's replica_group, a replicated DTensor by
    # its 1-D mesh (a LoRA factor beside its tp-split partner); each one orthogonalized by one owner there. Experts
    # split over ep are this rank's own (their replicas across dp each orthogonalize them too).
    shared: dict[int, tuple[dist.ProcessGroup, list[int]]] = {}
    for i in whole:
        p = params[i]
        group = p.device_mesh.get_group() if isinstance(p, DTensor) and p.device_mesh.ndim == 1 else None
        group = replica_group if not isinstance(p, DTensor) else None if _experts_whole(p) else group
        if group is not None and dist.get_world_size(group) > 1:
            shared.setdefault(id(group), (group, []))[1].append(i)
    for group, members in shared.values():
        done = replicated_exchange(group, [updates[i] for i in members], orthogonalize, wire_dtype, stats)
        for i, d in zip(members, done):
            result[i] = d
    for i in whole:
        if result[i] is None:
            result[i] = orthogonalize(updates[i])
            count_done(stats, updates[i])
    for group, members in exchanged.values():
        pieces = _exchange(group, [params[i] for i, _ in members], [updates[i] for i, _ in members],
                           [d for _, d in members], orthogonalize, wire_dtype, stats)  # fmt: skip
        for (i, _), piece in zip(members, pieces):
            result[i] = piece
    for mesh, shard_dim, members in hsdp.values():
        pieces = exchange_replicas(mesh, shard_dim, [params[i] for i, _ in members], [updates[i] for i, _ in members],
                                   [d for _, d in members], orthogonalize, wire_dtype, stats)  # fmt: skip
        for (i, _), piece in zip(members, pieces):
            result[i] = piece
    for mesh, members in meshes.values():
        shapes = [tuple(params[i].shape) for i, _ in members]
        pieces = exchange_two_axes(mesh, shapes, [d for _, d in members], [updates[i] for i, _ in members],
                                   orthogonalize, wire_dtype, stats)  # fmt: skip
        for (i, _), piece in zip(members, pieces):
            result[i] = piece
    return result  # type: ignore[return-value]


def replicated_exchange(
    group: dist.ProcessGroup,
    updates: list[Tensor],
    orthogonalize: Callable[[Tensor], Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
) -> list[Tensor]:
    """Whole matrices held alike by every rank of ``group`` (ZeRO-0): each orthogonalized by its owner alone
    (balanced by ``ns_cost``), whose result one ``all_to_all_single`` sends to every other rank. A rank sends
    ``b (W - 1) |owned|``, about ``b (W - 1) P / W``: as much as one all-gather of the results."""
    owner = owners([ns_cost(tuple(u.shape)) for u in updates], dist.get_world_size(group))
    done: list[Tensor | None] = [None] * len(updates)
    for m, update in enumerate(updates):
        if owner[m] == dist.get_rank(group):
            done[m] = orthogonalize(update)
            count_done(stats, update)
    return share_from_owners(group, owner, done, [u.shape for u in updates], wire_dtype, stats, updates[0].device)


def share_from_owners(
    group: dist.ProcessGroup,
    owner: list[int],
    done: list[Tensor | None],
    shapes: list[torch.Size],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
    device: torch.device,
) -> list[Tensor]:
    """``done[m]`` (set where this rank is ``owner[m]``, of shape ``shapes[m]``) sent by one ``all_to_all_single`` to
    every other rank of ``group``; returns every result."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    empty = torch.empty(0, dtype=wire_dtype, device=device)
    mine = torch.cat([d.reshape(-1).to(wire_dtype) for d in done if d is not None] or [empty])
    in_splits = [0 if q == rank else mine.numel() for q in range(world)]
    out_splits = [0 if q == rank else sum(prod(tuple(s)) for m, s in enumerate(shapes) if owner[m] == q) for q in
                  range(world)]  # fmt: skip
    received = all_to_all(torch.cat([mine] * (world - 1) or [empty]), in_splits, out_splits, group)
    chunks = received.split(out_splits)
    offsets = [0] * world
    result = list(done)
    for m, shape in enumerate(shapes):
        q = owner[m]
        if q != rank:
            result[m] = chunks[q][offsets[q] : offsets[q] + prod(tuple(shape))].view(shape)
            offsets[q] += prod(tuple(shape))
    count_sent(stats, sum(in_splits), wire_dtype)
    return result  # type: ignore[return-value]


def exchange_replicas(
    mesh: DeviceMesh,
    shard_dim: int,
    params: list[Tensor],
    updates: list[Tensor],
    dims: list[int],
    orthogonalize: Callable[[Tensor], Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
) -> list[Tensor]:
    """HSDP: matrices split over the shard group (mesh dim ``shard_dim``), replicated over the other mesh dim. Owners
    are (replica, shard rank) pairs over all of them: each replica's shard group orthogonalizes its share (the two
    ``all_to_all_single`` of :func:`owner_exchange`), then one more over the replicas sends each rank's pieces of
    them to its counterparts. A rank sends ``2 b (S - 1) P / (R S^2) + b (R - 1) P / (R S)``, about."""
    rep_dim = 1 - shard_dim
    replicas, shards, replica = mesh.size(rep_dim), mesh.size(shard_dim), mesh.get_local_rank(rep_dim)
    pair = owners([ns_cost(tuple(p.shape)) for p in params], replicas * shards)
    mine = [m for m in range(len(params)) if pair[m] // shards == replica]  # the same on my whole shard group
    done: list[Tensor | None] = [None] * len(params)
    if mine:
        pieces = _exchange(mesh.get_group(shard_dim), [params[m] for m in mine], [updates[m] for m in mine],
                           [dims[m] for m in mine], orthogonalize, wire_dtype, stats,
                           [pair[m] % shards for m in mine])  # fmt: skip
        for m, piece in zip(mine, pieces):
            done[m] = piece
    shapes = [u.shape for u in updates]
    owner = [q // shards for q in pair]
    return share_from_owners(mesh.get_group(rep_dim), owner, done, shapes, wire_dtype, stats, updates[0].device)


def _exchange(
    group: dist.ProcessGroup,
    params: list[Tensor],
    updates: list[Tensor],
    dims: list[int],
    orthogonalize: Callable[[Tensor], Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
    owner: list[int] | None = None,
) -> list[Tensor]:
    """The DTensor matrices of one group, each split by ``Shard(dims[m])``: slices along that dimension (``owner``:
    given owners, else balanced ones)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shapes = []  # shapes[m][q]: matrix m's slice on rank q
    for p, d in zip(params, dims):
        shape = list(p.shape)
        shapes.append([tuple(shape[:d] + [n] + shape[d + 1 :]) for n in chunk_sizes(shape[d], world)])

    def assemble(m: int, pieces: list[Tensor]) -> Tensor:
        return torch.cat([piece.view(shapes[m][q]) for q, piece in enumerate(pieces)], dim=dims[m])

    def cut(m: int, whole: Tensor) -> list[Tensor]:
        return [piece.reshape(-1) for piece in whole.split([s[dims[m]] for s in shapes[m]], dim=dims[m])]

    numels = [[prod(s) for s in per_rank] for per_rank in shapes]
    flat = [u.reshape(-1) for u in updates]
    costs = [ns_cost(tuple(p.shape)) for p in params]
    done = owner_exchange(group, numels, costs, flat, assemble, cut, orthogonalize, wire_dtype, stats, owner)
    return [piece.view(shapes[m][rank]) for m, piece in enumerate(done)]


@dataclass
class FlatMatrices:
    """ZeRO-1/2: the matrices packed in one flat buffer sharded over ``group``, rank ``q`` holding elements
    ``[q * shard_numel, (q + 1) * shard_numel)``: each matrix's offset and (whole) shape."""

    group: dist.ProcessGroup
    shard_numel: int
    offsets: list[int]
    shapes: list[torch.Size]
    lr_shapes: list[torch.Size] | None = None  # the (out, in) shape each learning rate is adjusted by (default: shapes)

    def lr_shape(self, m: int) -> torch.Size:
        return self.lr_shapes[m] if self.lr_shapes is not None else self.shapes[m]

    def segments(self, m: int, world: int) -> list[tuple[int, int]]:
        """Matrix ``m``'s elements on each rank: (start, end) in the flat buffer (end <= start: none)."""
        lo, hi = self.offsets[m], self.offsets[m] + prod(tuple(self.shapes[m]))
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

    costs = [ns_cost(tuple(shape)) for shape in layout.shapes]
    done = owner_exchange(layout.group, numels, costs, mine, assemble, cut, orthogonalize, wire_dtype, stats)
    here = [seg[rank] for seg in segments]
    return [(m, lo - base, hi - base, piece) for m, ((lo, hi), piece) in enumerate(zip(here, done)) if hi > lo]


__all__ = ["FlatMatrices", "chunk_sizes", "ns_cost", "orthogonalize_all", "orthogonalize_flat", "owners"]
