"""Case ``muon_exchange``: Muon's owner exchange (lightning_parallel/parallel/optim/muon_exchange.py) on DTensors
of a 1-D mesh over the world, split by Shard(0) and Shard(1) with uneven slices, against each whole matrix
orthogonalized in this process; plus the bytes it sent; ZeRO-1/2's flat layout, matrices cut across slices; and
ZeRO-0's whole matrices on every rank, each orthogonalized by one owner (the work per rank by Newton-Schulz cost).

    run.py muon_exchange --opts '{"ns_dtype": "float32"}' --out DIR

Its result: the largest difference from the local reference, the elements and bytes sent, the matrices this rank
orthogonalized, and the exchange's own formula for the bytes (from the owners and slice sizes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_parallel.parallel.optim.muon import NS_COEFFICIENTS, NS_DTYPES, newton_schulz
from lightning_parallel.parallel.optim.muon_exchange import (
    FlatMatrices,
    chunk_sizes,
    ns_cost,
    orthogonalize_all,
    orthogonalize_flat,
    owners,
    replicated_exchange,
)

PROCESS_GROUP = True
SHAPES = [((48, 32), 0), ((32, 48), 1), ((7, 5), 0), ((5, 7), 1), ((64, 16), 0), ((3, 9), 0)]


def run_case(case: dict, ctx) -> dict:
    dtype = NS_DTYPES[case["ns_dtype"]]
    mesh = init_device_mesh("cpu", (ctx.world,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(0)
    wholes = [torch.randn(shape, generator=g) for shape, _ in SHAPES]
    params = [distribute_tensor(w, mesh, [Shard(d)], src_data_rank=None) for w, (_, d) in zip(wholes, SHAPES)]

    def orthogonalize(x):
        return newton_schulz(x, NS_COEFFICIENTS, 5, 1e-7, dtype)

    stats: dict[str, int] = {}
    pieces = orthogonalize_all(params, [p.to_local() for p in params], orthogonalize, dtype, stats)
    worst = 0.0
    for piece, whole, (_, dim) in zip(pieces, wholes, SHAPES):
        want = orthogonalize(whole).chunk(ctx.world, dim=dim)
        want_piece = want[ctx.rank] if ctx.rank < len(want) else whole.new_empty(0)
        worst = max(worst, (piece.float() - want_piece.float()).abs().max().item() if piece.numel() else 0.0)
        assert piece.shape == want_piece.shape or piece.numel() == 0
    owner = owners([ns_cost(tuple(w.shape)) for w in wholes], ctx.world)
    slices = [[n * w.numel() // w.shape[d] for n in chunk_sizes(w.shape[d], ctx.world)] for w, (_, d) in
              zip(wholes, SHAPES)]  # fmt: skip
    formula = (
        sum(
            (w.numel() - s[ctx.rank]) if owner[m] == ctx.rank else s[ctx.rank]
            for m, (w, s) in enumerate(zip(wholes, slices))
        )
        * torch.finfo(dtype).bits
        // 8
    )
    return {
        "worst": worst,
        **stats,
        "formula_bytes": formula,
        "owners": owner,
        "flat": _flat(ctx, orthogonalize, dtype),
        "replicated": _replicated(wholes, orthogonalize, dtype),
    }


def _replicated(wholes, orthogonalize, dtype) -> dict:
    """ZeRO-0: the same whole matrices on every rank, each orthogonalized by one owner and sent to the others."""
    stats: dict[str, int] = {}
    done = replicated_exchange(dist.group.WORLD, wholes, orthogonalize, dtype, stats)
    worst = max((d.float() - orthogonalize(w).float()).abs().max().item() for d, w in zip(done, wholes))
    owner = owners([ns_cost(tuple(w.shape)) for w in wholes], dist.get_world_size())
    owned = sum(w.numel() for m, w in enumerate(wholes) if owner[m] == dist.get_rank())
    formula = (dist.get_world_size() - 1) * owned * torch.finfo(dtype).bits // 8  # b (W - 1) |owned|
    return {"worst": worst, **stats, "formula_bytes": formula, "costs": [ns_cost(tuple(w.shape)) for w in wholes]}


def _flat(ctx, orthogonalize, dtype) -> dict:
    """ZeRO-1/2's layout: matrices packed in one flat buffer cut into equal slices, one of them across the cut."""
    g = torch.Generator().manual_seed(1)
    shapes = [torch.Size(s) for s in ((5, 7), (6, 4), (3, 3), (8, 2), (2, 3))]
    wholes = [torch.randn(s, generator=g) for s in shapes]
    offsets = [sum(w.numel() for w in wholes[:m]) for m in range(len(wholes))]
    flat = torch.cat([w.reshape(-1) for w in wholes])
    shard = -(-flat.numel() // ctx.world)
    flat = torch.cat([flat, flat.new_zeros(shard * ctx.world - flat.numel())])
    layout = FlatMatrices(dist.group.WORLD, shard, offsets, shapes)
    stats: dict[str, int] = {}
    mine = flat[ctx.rank * shard : (ctx.rank + 1) * shard]
    pieces = orthogonalize_flat(layout, mine, orthogonalize, dtype, stats)
    want = torch.cat([orthogonalize(w).float().reshape(-1) for w in wholes])
    worst, covered = 0.0, 0
    for m, start, end, piece in pieces:
        lo = ctx.rank * shard + start
        worst = max(worst, (piece.float() - want[lo : lo + end - start]).abs().max().item())
        covered += end - start
        assert m == max(i for i in range(len(offsets)) if offsets[i] <= lo)
    crossing = sum(1 for m in range(len(shapes)) if sum(1 for a, b in layout.segments(m, ctx.world) if b > a) > 1)
    return {"worst": worst, "covered": covered, "crossing": crossing, **stats}
