"""Ring attention: exact causal attention over a sequence split across the context-parallel ranks. Pure torch.

Each rank holds the queries, keys and values of its two chunks (:mod:`.split`). Keys and values travel around the
cp ring (rank r sends to r + 1, receives from r - 1) while every rank attends its queries to the block it holds and
merges the blocks' results with their log-sum-exps (the online softmax of flash attention): after cp steps each
query has seen every key before it, and the output equals one process's. The split makes every block either causal
(a rank's own) or half visible without a mask (:func:`_visible`), so no fully masked scores are computed, and on CPU
each block runs torch's fused flash kernel, which returns the log-sum-exp the merge needs.

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


def _fused(q: Tensor) -> bool:
    return q.device.type == "cpu"


def _causal(tq: int, tk: int, device: torch.device) -> Tensor:
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril()


def _attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """One block's output and log-sum-exp (B, H, Tq): causal (a rank's own two chunks, in position order) or with
    every key visible. On CPU torch's fused flash kernel, which returns the log-sum-exp; elsewhere the same math
    unfused (the GPU kernels' log-sum-exp outputs differ by backend)."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~_causal(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def _attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one block, given the merged output and log-sum-exp of its query rows (flash attention's
    backward: probabilities exp(s - lse) and rowsum(dO * O) of the whole row, so blocks add up exactly)."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~_causal(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    delta = (dout * out).sum(-1, keepdim=True)
    dscores = probs * (torch.matmul(dout, v.transpose(-2, -1)) - delta) * scale
    return (
        torch.matmul(dscores, k),
        torch.matmul(dscores.transpose(-2, -1), q),
        torch.matmul(probs.transpose(-2, -1), dout),
    )


def _visible(rank: int, source: int, half: int) -> tuple[slice, slice]:
    """Which query rows of ``rank`` see which keys of ``source``'s block; all of those pairs are unmasked, the rest
    fully masked (the zigzag split: rank r holds chunks r and 2cp-1-r, source s chunks s and 2cp-1-s). For s < r both
    our chunks follow s's first chunk and precede its second: all our rows against its first half. For s > r our
    first chunk precedes both of s's, our second follows both: our second half against all its keys. Half the score
    blocks of the whole sequence are skipped, as causal attention allows."""
    everything = slice(None)
    return (everything, slice(0, half)) if source < rank else (slice(half, None), everything)


def _merge(out: Tensor, lse: Tensor, rows: slice, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of a block's result into ``rows`` of the running output and log-sum-exp."""
    old_out, old_lse = out[..., rows, :], lse[..., rows]
    merged = torch.logaddexp(old_lse, block_lse)
    new = old_out * torch.exp(old_lse - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
    out, lse = out.clone(), lse.clone()
    out[..., rows, :], lse[..., rows] = new, merged
    return out, lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float) -> Tensor:
        # the blocks are merged in fp32 whatever autocast would pick for the matmuls (the inputs are cast here)
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._forward(ctx, q, k, v, group, scale)

    @staticmethod
    def _forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float) -> Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        acc, half = _acc(q), q.shape[-2] // 2
        qa = q.to(acc)
        kv = torch.stack([k, v]).contiguous()
        out, lse = _attend(qa, k.to(acc), v.to(acc), True, scale)  # own block first: causal over our two chunks
        out, lse = out.to(acc), lse.to(acc)
        for step in range(1, cp):
            kv = _exchange(kv, group)
            SENT["forward"] += kv.numel() * kv.element_size()
            rows, keys = _visible(rank, (rank - step) % cp, half)
            kb, vb = (t[..., keys, :].to(acc).contiguous() for t in kv)
            block_out, block_lse = _attend(qa[..., rows, :].contiguous(), kb, vb, False, scale)
            out, lse = _merge(out, lse, rows, block_out.to(acc), block_lse.to(acc))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        acc, half = _acc(q), q.shape[-2] // 2
        qa, dout = q.to(acc), grad_out.to(acc).contiguous()
        dq, dk, dv = _attend_backward(dout, qa, k.to(acc), v.to(acc), out, lse, True, scale)
        # keys, values and their gradient accumulators travel together: (k, v, dk, dv)
        travelling = torch.stack([k.to(acc), v.to(acc), dk, dv])
        for step in range(1, cp):
            travelling = _exchange(travelling, group)
            SENT["backward"] += travelling.numel() * travelling.element_size()
            rows, keys = _visible(rank, (rank - step) % cp, half)
            kb, vb = (t[..., keys, :].contiguous() for t in travelling[:2])
            part = (dout[..., rows, :].contiguous(), qa[..., rows, :].contiguous(), kb, vb)
            dq_b, dk_b, dv_b = _attend_backward(
                *part, out[..., rows, :].contiguous(), lse[..., rows].contiguous(), False, scale
            )
            dq[..., rows, :] += dq_b
            travelling[2][..., keys, :] += dk_b
            travelling[3][..., keys, :] += dv_b
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
