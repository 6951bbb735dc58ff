"""Muon (:class:`~lightning_parallel.parallel.optim.muon.MuonAdamW`) in the analytic planner: its state, its owner
exchange and its Newton-Schulz work. Pure Python (the owner rule is the optimizer's own function).

- Which parameters: the split rule's, on a model shape (:func:`muon_matrices`): every attention projection and
  dense or shared-expert MLP linear. AdamW keeps the embeddings, the head, norms, biases, the routed experts
  (stacked 3-D tensors) and the routers (Hugging Face's are plain parameters; the recipe's ``Router`` is a Linear
  and goes to Muon there: ``hidden x experts`` a layer, left out here).
- State: one momentum buffer per Muon element against AdamW's two moments, so ``(2 + 1)`` element-bytes per Muon
  parameter besides the parameter and gradient, sharded as the ZeRO stage shards optimizer states.
- Newton-Schulz (:func:`newton_schulz_flops`): torch's quintic iteration on the matrix turned wide (``m <= n``),
  5 steps of ``A = X X^T`` (2 m^2 n), ``B = b A + c A A`` (2 m^3) and ``X = a X + B X`` (2 m^2 n).
- Who orthogonalizes what (``parallel/optim/muon_exchange.py``): a matrix split on one group (ZeRO 1-3 over the
  data-parallel shard group, or tp at ZeRO-0) is gathered to one owner, owners balanced by Newton-Schulz cost
  (``ns_cost``), and sent back
  in ``ns_dtype`` (bf16: 2 bytes): one rank of a group of ``W`` sends (:func:`exchange_bytes`)::

      b * ( sum_{m not owned} s_m  +  sum_{m owned} (|m| - s_m) )  ~=  2 b (W - 1) P / W**2

  and does about 1/W of the iterations (at least the largest matrix's). Whole matrices (ZeRO-0 without tp) are
  orthogonalized on their owner among the dp replicas, whose results go to the others: ``b (W - 1) P / W`` a rank.
  Matrices split on two mesh dimensions (ZeRO-3 with tp, A x B ranks) go over dp, then tp, then back:
  ``2 b P ((A - 1) / A + (B - 1) / B) / (A B)`` a rank. HSDP (R replicas of S shards): the shard group's exchange of
  each replica's share, then its results across the replicas: ``2 b (S - 1) P / (R S^2) + b (R - 1) P / (R S)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_parallel.parallel.optim.muon import split_params
from lightning_parallel.parallel.optim.muon_owners import chunk_sizes, ns_cost, owners
from lightning_parallel.planning.hf_config import ModelShape
from lightning_parallel.planning.matrices import Matrix, stage_matrices

NS_STEPS = 5  # MuonAdamW's (and torch.optim.Muon's) default ns_steps
NS_BYTES = 2  # ns_dtype bfloat16, the default: what the exchange sends per element
MUON_KINDS = ("attention", "mlp")


def muon_matrices(shape: ModelShape, dense: int, moe: int) -> list[tuple[Matrix, int]]:
    """The Muon matrices of ``dense`` dense and ``moe`` MoE layers, each with how many layers hold it."""
    return [(m, n) for m, n in stage_matrices(shape, dense, moe) if m.kind in MUON_KINDS and m.numel and n]


def muon_params(shape: ModelShape, dense: int, moe: int) -> int:
    """Elements of the Muon matrices of ``dense`` dense and ``moe`` MoE layers (whole, before tp)."""
    return sum(m.numel * n for m, n in muon_matrices(shape, dense, moe))


def states_per_param(model: nn.Module, adamw_states: int = 2) -> float:
    """Optimizer-state tensors per trainable parameter of ``model`` under MuonAdamW's split rule (its own
    :func:`~lightning_parallel.parallel.optim.muon.split_params`): one for Muon's matrices, ``adamw_states`` for
    the rest, averaged over the model (what the profiling planner's one figure per parameter can hold)."""
    muon, decay, no_decay = split_params(model)
    matrices, rest = sum(p.numel() for p in muon), sum(p.numel() for p in decay + no_decay)
    return (matrices + adamw_states * rest) / max(1, matrices + rest)


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> float:
    """FLOPs of orthogonalizing one ``rows x cols`` matrix: ``steps`` x (4 m^2 n + 2 m^3), m <= n."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def ns_flops(shape: ModelShape, dense: int, moe: int, world: int = 1) -> float:
    """Newton-Schulz FLOPs of the busiest of ``world`` owners of the matrices of ``dense`` and ``moe`` layers
    (balanced: 1/world of the total, at least the largest matrix's; world=1: one rank does them all)."""
    each = [(newton_schulz_flops(m.rows, m.cols), n) for m, n in muon_matrices(shape, dense, moe)]
    total = sum(f * n for f, n in each)
    return max(total / world, max((f for f, _ in each), default=0.0)) if world > 1 else total


def exchange_bytes(params: float, world: int, elem: int = NS_BYTES) -> float:
    """Bytes one rank sends in the owner exchange of ``params`` Muon elements split over ``world`` ranks:
    2 b (W-1) P / W^2 (owners balanced, slices even)."""
    return 2.0 * elem * (world - 1) * params / world**2 if world > 1 else 0.0


def exchange_sent(shapes: Sequence[tuple[int, int]], world: int, elem: int = NS_BYTES, dim: int = 0) -> list[int]:
    """Bytes each rank sends in the owner exchange of matrices ``shapes`` split by ``Shard(dim)`` over ``world``
    ranks, exactly: ``torch.chunk``'s slices and the owners of
    :func:`~lightning_parallel.parallel.optim.muon_owners.owners` by ``ns_cost``: what
    ``MuonAdamW.exchange["sent_bytes"]`` counts."""
    slices = []  # slices[m][q]: matrix m's elements on rank q
    for rows, cols in shapes:
        length, other = (rows, cols) if dim == 0 else (cols, rows)
        slices.append([n * other for n in chunk_sizes(length, world)])
    owner = owners([ns_cost((rows, cols)) for rows, cols in shapes], world)
    sent = []
    for rank in range(world):
        elements = sum(s[rank] for m, s in enumerate(slices) if owner[m] != rank)
        elements += sum(sum(s) - s[rank] for m, s in enumerate(slices) if owner[m] == rank)
        sent.append(elements * elem)
    return sent
