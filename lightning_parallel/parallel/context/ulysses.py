"""All-to-all ("Ulysses", DeepSpeed) context parallelism: exact causal attention by trading the sequence split for
a head split. Pure torch.

Each rank holds all heads of its two chunks of the sequence (:mod:`.split`). One all-to-all over the cp ranks
gives each rank ``heads / cp`` of the heads for the whole sequence; it reorders the gathered chunks into sequence
order, runs ordinary causal attention, and a second all-to-all gives every rank back all heads of its own chunks.
The heads must divide by cp (under tensor parallelism: the heads each tp rank holds). Bytes sent per rank and layer:
(cp - 1) / cp of its q, k, v and output in forward, as much again for their gradients in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_parallel.parallel.context.split import to_natural_order, to_rank_order


def check_heads(heads: int, cp: int, tp: int = 1, setting: str = "cp_mode='ulysses'") -> None:
    """A ValueError naming the setting and the fix unless ``cp`` divides the heads each tp rank holds."""
    if heads % (tp * cp):
        local = f"n_head / tp = {heads} / {tp} = {heads // tp}" if tp > 1 else f"n_head = {heads}"
        raise ValueError(
            f"{setting} with cp={cp} gives each rank 1/cp of the attention heads, and {local} does not divide by "
            f"cp={cp}: choose cp (times tp) dividing the model's n_head={heads}, or cp_mode='ring', which splits "
            "no heads."
        )


def _heads_to_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(B, H, T/cp, D) all heads of this rank's chunks -> (B, H/cp, T, D) some heads of the whole sequence."""
    cp = dist.get_world_size(group)
    B, H, t, D = x.shape
    send = x.reshape(B, cp, H // cp, t, D).transpose(0, 1).contiguous()  # (cp, B, H/cp, t, D): piece j to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's chunks of my heads
    gathered = recv.reshape(cp, B, H // cp, 2, t // 2, D).permute(1, 2, 0, 3, 4, 5)  # (B, H/cp, cp, 2, t/2, D)
    return to_natural_order(gathered, dim=2).reshape(B, H // cp, cp * t, D)


def _sequence_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The inverse of :func:`_heads_to_sequence`."""
    cp = dist.get_world_size(group)
    B, h, T, D = x.shape
    t = T // cp
    chunks = x.reshape(B, h, 2 * cp, t // 2, D)
    gathered = to_rank_order(chunks, dim=2)  # (B, h, cp, 2, t/2, D): rank 0's two chunks, rank 1's two, ...
    send = gathered.reshape(B, h, cp, t, D).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, h, t, D): to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: heads j*h.. of my chunks
    return recv.permute(1, 0, 2, 3, 4).reshape(B, cp * h, t, D)


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _sequence_to_heads(grad, ctx.group), None


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _heads_to_sequence(grad, ctx.group), None


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float | None = None) -> Tensor:
    """Causal attention of this rank's chunks over the whole sequence, by all-to-all over heads.

    Args:
        q, k, v: (B, H, T / cp, D), this rank's two chunks (:func:`.split.shard_sequence`); cp divides H.
        group: the context-parallel ranks, in the order the sequence was split.
        scale: the score scale (default 1 / sqrt(D)).

    Returns:
        (B, H, T / cp, D): this rank's rows of causal attention over the whole sequence.
    """
    q, k, v = (_HeadsToSequence.apply(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return _SequenceToHeads.apply(out, group)
