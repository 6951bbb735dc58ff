"""The load-balanced split of a sequence over the context-parallel ranks, and its inverse. Pure torch.

Causal attention gives later tokens more keys to attend to: cutting the sequence into cp contiguous pieces would
leave the last rank with most of the work. Instead the sequence is cut into ``2 * cp`` chunks and rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r`` (one early, one late, mirrored), so every rank does the same attention work
(Megatron-Core's and torchtitan's "load-balanced" or zigzag layout)::

    cp=2, T=8:  chunks 0 1 2 3 (2 tokens each)   rank 0: chunks 0, 3   rank 1: chunks 1, 2
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_sequence(seq_len: int, cp: int, setting: str = "cp") -> None:
    """A ValueError naming ``setting`` and the fix unless ``2 * cp`` divides ``seq_len``."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"{setting}={cp} splits each sequence into 2 * cp = {2 * cp} equal chunks (two per rank, for causal load "
            f"balancing), and the sequence length {seq_len} does not divide by {2 * cp}: choose cp so that 2 * cp "
            f"divides {seq_len}, or a sequence length that is a multiple of {2 * cp}."
        )


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * cp``) rank ``rank`` holds: ``rank`` and its mirror."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's two chunks of ``x`` along ``dim``, concatenated (early chunk first)."""
    check_sequence(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = rank_chunks(rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(pieces: list[Tensor], dim: int = 1) -> Tensor:
    """The inverse of :func:`shard_sequence`: every rank's piece (rank order) back into the whole sequence."""
    cp = len(pieces)
    chunks: list[Tensor | None] = [None] * (2 * cp)
    for rank, piece in enumerate(pieces):
        first, second = rank_chunks(rank, cp)
        chunks[first], chunks[second] = piece.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def positions(local_len: int, cp: int, rank: int, device: torch.device | None = None) -> Tensor:
    """The positions in the whole sequence of this rank's ``local_len`` tokens (its two chunks), made on ``device``
    (no host tensor to copy there in every forward)."""
    chunk = local_len // 2
    first, second = rank_chunks(rank, cp)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def to_natural_order(gathered: Tensor, dim: int) -> Tensor:
    """The ``2 * cp`` chunks gathered in rank order, ``gathered`` (..., cp, 2, ...) with ranks at ``dim`` and each
    rank's two chunks at ``dim + 1``, in sequence order along ``dim`` (..., 2 * cp, ...): the ranks' early chunks in
    rank order, then their late chunks in reverse rank order (rank ``r`` holds ``r`` and ``2 * cp - 1 - r``). A
    view and one copy, no index tensor (nothing to build on the host and copy to the device per call)."""
    early, late = gathered.select(dim + 1, 0), gathered.select(dim + 1, 1)
    return torch.cat([early, late.flip(dim)], dim=dim)


def to_rank_order(chunks: Tensor, dim: int) -> Tensor:
    """The inverse of :func:`to_natural_order`: (..., 2 * cp, ...) in sequence order -> (..., cp, 2, ...)."""
    early, late = chunks.chunk(2, dim=dim)
    return torch.stack([early, late.flip(dim)], dim=dim + 1)


def natural_order(cp: int) -> Tensor:
    """Indices that put the ``2 * cp`` chunks gathered in rank order (rank 0's two, rank 1's two, ...) back into
    sequence order: ``gathered[natural_order(cp)]`` is chunks 0, 1, ..., 2cp - 1."""
    gathered = [c for rank in range(cp) for c in rank_chunks(rank, cp)]
    return torch.argsort(torch.tensor(gathered))
