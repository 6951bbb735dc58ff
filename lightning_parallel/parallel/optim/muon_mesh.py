"""Muon's matrices split on two mesh dimensions (dp x tp with ZeRO-3: FSDP2's ``Shard(0)`` or ``_StridedShard(0)``
over dp, tensor parallelism's ``Shard(d)`` over tp), each orthogonalized once on one owner of the dp x tp ranks.
Pure torch.

Owners are pairs (dp index ``i``, tp index ``j``), balanced over all ``A x B`` ranks by Newton-Schulz cost. Three
steps, each a pair of ``all_to_all_single``:

1. over dp (every tp index ``j`` alike): each matrix's dp slices of its tp piece go to dp rank ``i``, which joins
   them (FSDP2 cut the tp piece along dim 0);
2. over tp, in the tp group of dp index ``i`` only: the tp pieces go to tp rank ``j``, which joins them along ``d``,
   orthogonalizes the whole matrix, cuts it and sends the tp pieces back;
3. over dp: rank ``i`` cuts its tp piece of the result and sends each dp rank its slice.

Bytes over all ranks per step, ``P`` elements of such matrices, even slices: ``2 b P ((A - 1) / A + (B - 1) / B)``
(step 1 and 3 move each matrix's ``(A - 1) / A`` twice, step 2 its ``(B - 1) / B`` twice); per rank that sum over
``A B`` with balanced owners. Orthogonalizing on every rank after a ``full_tensor`` instead sends
``b (A B - 1) P`` per rank and repeats each matrix's iteration on all ``A B`` ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_parallel.parallel.optim.muon_owners import (
    chunk_sizes,
    count_done,
    gather_to_owners,
    ns_cost,
    owners,
    prod,
    scatter_from_owners,
)


def two_axes(p: DTensor) -> int | None:
    """The tp dimension ``d`` when ``p`` is a 2-D mesh's (dim 0 split over mesh dim 0, ``Shard(d)`` over mesh dim 1)
    and its local piece is the one :func:`local_shape` says; else None."""
    if p.device_mesh.ndim != 2 or p.ndim != 2:
        return None
    outer, inner = p.placements
    if outer.is_replicate() or getattr(outer, "dim", None) != 0 or type(inner) is not Shard:
        return None
    d = inner.dim
    mesh = p.device_mesh
    want = local_shape(tuple(p.shape), d, mesh.size(0), mesh.size(1), mesh.get_local_rank(0), mesh.get_local_rank(1))
    return d if tuple(p.to_local().shape) == want else None


def tp_shape(shape: tuple[int, ...], d: int, tp: int, j: int) -> tuple[int, ...]:
    sizes = list(shape)
    sizes[d] = chunk_sizes(shape[d], tp)[j]
    return tuple(sizes)


def local_shape(shape: tuple[int, ...], d: int, dp: int, tp: int, i: int, j: int) -> tuple[int, ...]:
    """Rank (i, j)'s piece: the tp piece ``j`` along ``d``, then dp slice ``i`` of it along dim 0."""
    piece = tp_shape(shape, d, tp, j)
    return (chunk_sizes(piece[0], dp)[i], *piece[1:])


def exchange_two_axes(
    mesh: DeviceMesh,
    shapes: list[tuple[int, ...]],
    dims: list[int],
    updates: list[Tensor],
    orthogonalize: Callable[[Tensor], Tensor],
    wire_dtype: torch.dtype,
    stats: dict[str, int],
) -> list[Tensor]:
    """Each matrix (global ``shapes[m]``, tp dimension ``dims[m]``, this rank's piece ``updates[m]``) orthogonalized
    whole on its owner (module docstring); returns this rank's piece of each result."""
    dp, tp = mesh.size(0), mesh.size(1)
    j = mesh.get_local_rank(1)
    dp_group, tp_group = mesh.get_group(0), mesh.get_group(1)
    device = updates[0].device
    pair = owners([ns_cost(s) for s in shapes], dp * tp)
    owner_dp, owner_tp = [q // tp for q in pair], [q % tp for q in pair]
    pieces = [tp_shape(s, d, tp, j) for s, d in zip(shapes, dims)]  # my tp piece's shape of each matrix
    rows = [chunk_sizes(piece[0], dp) for piece in pieces]
    numels = [[r * prod(piece[1:]) for r in rs] for rs, piece in zip(rows, pieces)]
    # 1: the dp slices of each tp piece to dp rank owner_dp[m]
    gathered = gather_to_owners(dp_group, numels, owner_dp, updates, wire_dtype, stats, device)
    mine = sorted(gathered)  # the matrices my dp index owns: the same list on every rank of my tp group
    joined = [torch.cat([x.view(r, *pieces[m][1:]) for x, r in zip(gathered[m], rows[m])]) for m in mine]
    # 2: within my tp group, the tp pieces to tp rank owner_tp[m]; orthogonalized whole there
    tp_shapes = [[tp_shape(shapes[m], dims[m], tp, q) for q in range(tp)] for m in mine]
    tp_numels = [[prod(s) for s in per_rank] for per_rank in tp_shapes]
    tp_owner = [owner_tp[m] for m in mine]
    at_owner = gather_to_owners(tp_group, tp_numels, tp_owner, joined, wire_dtype, stats, device)
    done = {}
    for k, parts in at_owner.items():
        m = mine[k]
        whole = torch.cat([x.view(s) for x, s in zip(parts, tp_shapes[k])], dim=dims[m])
        count_done(stats, whole)
        sizes = [s[dims[m]] for s in tp_shapes[k]]
        done[k] = list(orthogonalize(whole).split(sizes, dim=dims[m]))
    back = scatter_from_owners(tp_group, tp_numels, tp_owner, done, wire_dtype, stats, device)
    # 3: each dp rank its slice of the tp piece of the result
    slices = {m: list(back[k].view(pieces[m]).split(rows[m])) for k, m in enumerate(mine)}
    result = scatter_from_owners(dp_group, numels, owner_dp, slices, wire_dtype, stats, device)
    return [r.view(u.shape) for r, u in zip(result, updates)]
