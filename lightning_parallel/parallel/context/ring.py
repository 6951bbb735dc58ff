"""Ring attention: exact causal attention over a sequence split across the context-parallel ranks. Pure torch.

Each rank holds the queries, keys and values of its two chunks (:mod:`.split`). Keys and values travel around the
cp ring (rank r sends to r + 1, receives from r - 1) while every rank attends its queries to the block it holds and
merges the blocks' results with their log-sum-exps (the online softmax of flash attention): after cp steps each
query has seen every key before it, and the output equals one process's. The split makes every block either causal
(a rank's own) or half visible without a mask (:func:`_visible`), so no fully masked scores are computed. Each block
runs the fused kernel of its device that returns the log-sum-exp (:mod:`.kernels`: CPU flash, CUDA flash or
memory-efficient in bf16/fp16, the unfused math elsewhere); the merge accumulates in fp32 (or wider), in place.

Communication overlaps computation on every backend: the next hop's exchange (:class:`RingHop`, an async
``batch_isend_irecv``) is posted before the current block is computed and waited for only when its tensors are
needed. Backward runs the ring again: keys and values travel ahead the same way, and with them accumulators of their
gradients, which each rank adds its part to and sends on at once (in flight during the next block's compute); a last
hop returns every accumulator to the rank that owns those keys. Everything travels in the input dtype (the
accumulators: ``grad_dtype``, default the input's; fp32 runs are exact either way, and bf16 accumulators are rounded
once per rank they pass: see ``ring_attention``). Bytes sent per rank and layer (``ring_bytes``): forward
(cp - 1) x (K + V), backward (cp - 1) x (K + V) + cp x (dK + dV).

torch's ``context_parallel`` (``torch.distributed.tensor.experimental``) works on DTensor-dispatched SDPA and has no
CPU kernel; this module takes the same approach (zigzag split, LSE merge, rotating K/V and dK/dV) on plain tensors.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_parallel.parallel.context.kernels import (
    block_attention,
    block_attention_backward,
    compute_dtype,
    kernel_for,
)

# bytes each rank sent, by direction ("forward", "backward"): the comm-volume test reads it
SENT: dict[str, int] = {"forward": 0, "backward": 0}
KV_TAG, GRAD_TAG = 0, 2  # gloo matches sends to receives by tag: keys/values and accumulators never cross


class RingHop:
    """One exchange around the ring, posted at once and in flight until :meth:`wait`: ``tensors`` leave for the next
    rank, tensors like them arrive from the previous one (one ``batch_isend_irecv``, tags ``tag``, ``tag + 1``...).
    The sent tensors must not change until then (they may be read)."""

    def __init__(self, tensors: list[Tensor], group: dist.ProcessGroup, direction: str, tag: int) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        after, before = (dist.get_global_rank(group, (rank + d) % size) for d in (1, -1))
        self.sent = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in self.sent]
        ops = [dist.P2POp(dist.isend, t, after, group, tag + i) for i, t in enumerate(self.sent)]
        ops += [dist.P2POp(dist.irecv, t, before, group, tag + i) for i, t in enumerate(self.received)]
        self._works = dist.batch_isend_irecv(ops)
        SENT[direction] += sum(t.numel() * t.element_size() for t in self.sent)

    def wait(self) -> list[Tensor]:
        """The previous rank's tensors (on CUDA: the current stream waits for them, the host does not)."""
        for work in self._works:
            work.wait()
        return self.received


def _visible(rank: int, source: int, half: int) -> tuple[slice, slice]:
    """Which query rows of ``rank`` see which keys of ``source``'s block; all of those pairs are unmasked, the rest
    fully masked (the zigzag split: rank r holds chunks r and 2cp-1-r, source s chunks s and 2cp-1-s). For s < r both
    our chunks follow s's first chunk and precede its second: all our rows against its first half. For s > r our
    first chunk precedes both of s's, our second follows both: our second half against all its keys. Half the score
    blocks of the whole sequence are skipped, as causal attention allows."""
    everything = slice(None)
    return (everything, slice(0, half)) if source < rank else (slice(half, None), everything)


def _merge(out: Tensor, lse: Tensor, rows: slice, block_out: Tensor, block_lse: Tensor) -> None:
    """Online-softmax merge of a block's result into ``rows`` of the running output and log-sum-exp, in place (the
    sigmoid form of torch's context parallel: the block's share of the merged softmax is sigmoid(lse_b - lse))."""
    old_out, old_lse = out[..., rows, :], lse[..., rows]
    share = torch.sigmoid(block_lse - old_lse)
    old_out.lerp_(block_out.to(out.dtype), share.unsqueeze(-1))
    old_lse.sub_(F.logsigmoid(old_lse - block_lse))  # log(e^a + e^b) = a - log(sigmoid(a - b))


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float, kernel: str):
    """This rank's merged output and log-sum-exp, (B, H, T/cp, D) and (B, H, T/cp), in fp32 (or wider)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    acc, half = torch.promote_types(q.dtype, torch.float32), q.shape[-2] // 2
    k, v = k.contiguous(), v.contiguous()  # once, for the first hop and the first block
    hop = RingHop([k, v], group, "forward", KV_TAG) if cp > 1 else None
    out, lse = block_attention(q, k, v, True, scale, kernel)  # own block first: causal over our two chunks
    out, lse = out.to(acc), lse.to(acc).contiguous()
    for step in range(1, cp):
        kb, vb = hop.wait()
        hop = RingHop([kb, vb], group, "forward", KV_TAG) if step < cp - 1 else None  # passed on as we compute
        rows, keys = _visible(rank, (rank - step) % cp, half)
        block = block_attention(q[..., rows, :], kb[..., keys, :], vb[..., keys, :], False, scale, kernel)
        _merge(out, lse, rows, *block)
    return out, lse


def _ring_backward(dout: Tensor, q, k, v, out, lse, group: dist.ProcessGroup, scale: float, kernel: str, wire):
    """dq, dk, dv of this rank's q, k, v; the dK/dV accumulators travel in ``wire``."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    half, k, v = q.shape[-2] // 2, k.contiguous(), v.contiguous()
    kv_hop = RingHop([k, v], group, "backward", KV_TAG) if cp > 1 else None
    dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, True, scale, kernel)
    dq = dq.to(torch.promote_types(q.dtype, torch.float32))
    grads = [dk.to(wire), dv.to(wire)]  # the accumulators of our keys' and values' gradients
    grad_hop = RingHop(grads, group, "backward", GRAD_TAG) if cp > 1 else None
    for step in range(1, cp):
        kb, vb = kv_hop.wait()
        kv_hop = RingHop([kb, vb], group, "backward", KV_TAG) if step < cp - 1 else None
        rows, keys = _visible(rank, (rank - step) % cp, half)
        part = (dout[..., rows, :], q[..., rows, :], kb[..., keys, :], vb[..., keys, :], out[..., rows, :])
        dq_b, dk_b, dv_b = block_attention_backward(*part, lse[..., rows], False, scale, kernel)
        dq[..., rows, :] += dq_b
        grads = grad_hop.wait()  # the accumulators of source (rank - step)'s keys: the ranks before us added theirs
        grads[0][..., keys, :] += dk_b  # in the accumulator's dtype: one rounding per rank for 16-bit ones
        grads[1][..., keys, :] += dv_b
        grad_hop = RingHop(grads, group, "backward", GRAD_TAG)  # sent on at once, in flight during the next block
    if grad_hop is not None:
        grads = grad_hop.wait()  # the last hop took every accumulator home: ours now holds every rank's part
    return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: dist.ProcessGroup, scale: float, kernel: str | None, grad_dtype):
        kernel = kernel or kernel_for(q, k, v)  # one kernel for every block, forward and backward
        # the blocks merge in fp32 or wider whatever autocast would pick (the kernels get the input dtype)
        with torch.autocast(q.device.type, enabled=False):
            merged, lse = _ring_forward(q, k, v, group, scale, kernel)
        out = merged.to(q.dtype)
        # the backward kernels take the merged output in their compute dtype: the returned one on CUDA
        dtype = compute_dtype(kernel, q.dtype)
        ctx.save_for_backward(q, k, v, out if dtype == q.dtype else merged.to(dtype), lse)
        ctx.group, ctx.scale, ctx.kernel, ctx.wire = group, scale, kernel, grad_dtype or k.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            grads = _ring_backward(grad_out, q, k, v, out, lse, ctx.group, ctx.scale, ctx.kernel, ctx.wire)
        return *grads, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    scale: float | None = None,
    kernel: str | None = None,
    grad_dtype: torch.dtype | None = None,
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    Args:
        q, k, v: (B, H, T / cp, D), this rank's two chunks of the sequence (:func:`.split.shard_sequence`).
        group: the context-parallel ranks, in the order the sequence was split.
        scale: the score scale (default 1 / sqrt(D), as ``scaled_dot_product_attention``).
        kernel: the block kernel (:data:`.kernels.KERNELS`); None picks by device (:func:`.kernels.kernel_for`).
        grad_dtype: the dtype the dK/dV accumulators travel in (default: the input's). fp32 and wider inputs are
            exact either way; a 16-bit accumulator is rounded once per rank it passes (cp roundings of partial sums
            instead of one: at cp=4 in bf16, dV 0.77% of its largest value off fp64 where one process is 0.44%
            off, tests/test_ring_precision.py); ``torch.float32`` doubles those bytes and rounds once.

    Returns:
        (B, H, T / cp, D): this rank's rows of the output of causal attention over the whole sequence.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, group, scale, kernel, grad_dtype)


def ring_bytes(local_kv_bytes: int, cp: int, grad_kv_bytes: int | None = None) -> dict[str, int]:
    """Bytes one rank sends per attention layer and step, ``local_kv_bytes`` its K plus V in the input dtype and
    ``grad_kv_bytes`` their gradient accumulators (default: as many, the accumulators in the input dtype): forward
    (cp - 1) hops of K and V; backward (cp - 1) hops of K and V, cp of the accumulators (none at cp=1)."""
    grad_kv_bytes = local_kv_bytes if grad_kv_bytes is None else grad_kv_bytes
    grad_hops = cp if cp > 1 else 0
    return {"forward": (cp - 1) * local_kv_bytes, "backward": (cp - 1) * local_kv_bytes + grad_hops * grad_kv_bytes}
