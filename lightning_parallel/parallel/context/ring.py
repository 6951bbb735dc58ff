"""Ring attention: exact causal attention over a sequence split across the context-parallel ranks. Pure torch.

Each rank holds the queries, keys and values of its two chunks (:mod:`.split`). Keys and values travel around the
cp ring (rank r sends to r + 1, receives from r - 1) while every rank attends its queries to the block it holds,
masked by the tokens' true positions, and merges the blocks' results with their log-sum-exps (the online softmax
of flash attention): after cp steps each query has seen every key before it, and the output equals one process's.

Backward runs the ring again: the keys and values travel with accumulators of their gradients, each rank adds the
part its queries contribute, and a last hop returns every accumulator to the rank that owns those keys. Bytes sent
per rank and layer (``ring_bytes``): forward (cp - 1) x (K + V), backward (cp - 1) x (K + V) + cp x (dK + dV).

torch's ``context_parallel`` (``torch.distributed.tensor.experimental``) dispatches only the flash, efficient and
cuDNN attention kernels: on CPU scaled_dot_product_attention runs its own kernel, so this module is used there.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.context.split import positions

# bytes each rank sent, by direction ("forward", "backward"): the comm-volume test reads it
SENT: dict[str, int] = {"forward": 0, "backward": 0}


def _exchange(send: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Send ``send`` to the next rank of the ring, receive the previous rank's (same shape)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv


def _acc(t: Tensor) -> torch.dtype:
    """The dtype blocks are computed and merged in: fp32, or the input's when wider."""
    return torch.promote_types(t.dtype, torch.float32)


def _block(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Masked scores (B, H, Tq, Tk), in fp32 at least."""
    acc = _acc(q)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    return scores.masked_fill(~mask, float("-inf"))


def _block_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One block's output and log-sum-exp; rows with no visible key give output 0 and lse -inf."""
    scores = _block(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Tq)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe.unsqueeze(-1))
    return torch.matmul(probs, v.to(probs.dtype)), lse


def _masks(local_len: int, cp: int, rank: int, device: torch.device) -> list[Tensor]:
    """Step i's mask (Tq, Tk): this rank's query positions against those of rank (rank - i)'s keys."""
    mine = positions(local_len, cp, rank, device)
    return [positions(local_len, cp, (rank - i) % cp, device).unsqueeze(0) <= mine.unsqueeze(1) for i in range(cp)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float) -> Tensor:
        # the blocks are merged in fp32 whatever autocast would pick for the matmuls (the inputs are cast here)
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._forward(ctx, q, k, v, group, scale)

    @staticmethod
    def _forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float) -> Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        masks = _masks(q.shape[-2], cp, rank, q.device)
        kv = torch.stack([k, v]).contiguous()
        out, lse = _block_forward(q, k, v, masks[0], scale)  # own block first: every query sees itself
        for step in range(1, cp):
            kv = _exchange(kv, group)
            SENT["forward"] += kv.numel() * kv.element_size()
            block_out, block_lse = _block_forward(q, kv[0], kv[1], masks[step], scale)
            merged = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
            lse = merged
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        masks = _masks(q.shape[-2], cp, rank, q.device)
        acc = _acc(q)
        dout = grad_out.to(acc)
        delta = (dout * out.to(acc)).sum(-1, keepdim=True)  # (B, H, Tq, 1): rowsum(dO * O)
        dq = torch.zeros_like(q, dtype=acc)
        # keys, values and their gradient accumulators travel together: (k, v, dk, dv)
        travelling = torch.stack([k.to(acc), v.to(acc), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)])
        for step in range(cp):
            if step:
                travelling = _exchange(travelling, group)
                SENT["backward"] += travelling.numel() * travelling.element_size()
            kb, vb = travelling[0], travelling[1]
            probs = torch.exp(_block(q, kb, masks[step], scale) - lse.unsqueeze(-1))  # masked: exp(-inf) = 0
            travelling[3] += torch.matmul(probs.transpose(-2, -1), dout)
            dscores = probs * (torch.matmul(dout, vb.transpose(-2, -1)) - delta) * scale
            dq += torch.matmul(dscores, kb)
            travelling[2] += torch.matmul(dscores.transpose(-2, -1), q.to(acc))
        # the accumulators now hold every rank's part: one hop takes them home (the keys themselves stay)
        grads = travelling[2:].contiguous()
        if cp > 1:
            grads = _exchange(grads, group)
            SENT["backward"] += grads.numel() * grads.element_size()
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float | None = None) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    Args:
        q, k, v: (B, H, T / cp, D), this rank's two chunks of the sequence (:func:`.split.shard_sequence`).
        group: the context-parallel ranks, in the order the sequence was split.
        scale: the score scale (default 1 / sqrt(D), as ``scaled_dot_product_attention``).

    Returns:
        (B, H, T / cp, D): this rank's rows of the output of causal attention over the whole sequence.
    """
    return _RingAttention.apply(q, k, v, group, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))


def ring_bytes(local_kv_bytes: int, cp: int) -> dict[str, int]:
    """Bytes one rank sends per attention layer and step, ``local_kv_bytes`` its K plus V (backward counts them at
    fp32 or wider): forward (cp - 1) hops of K and V; backward (cp - 1) hops of K, V, dK and dV, one of dK and dV."""
    return {"forward": (cp - 1) * local_kv_bytes, "backward": (2 * cp - 1) * local_kv_bytes}
