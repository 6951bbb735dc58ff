"""Plain data parallelism (ZeRO stage 0) for parameters that may be tensor-parallel DTensors. Pure torch.

Hand-written because torch's DDP does not take DTensor parameters: after the last backward of a step,
the local gradients are averaged over the dp group in one flat bucket per dtype.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def all_reduce_gradients(params: Iterable[Tensor], group: dist.ProcessGroup) -> None:
    """Average every parameter's (local) gradient over ``group`` in place; missing gradients count as 0."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            # every rank must contribute the same buffer layout, so a missing gradient becomes zeros
            p.grad = torch.zeros_like(p)
        if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
            p.grad = p.grad.redistribute(placements=p.placements)  # e.g. Partial over tp: reduce it first
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        by_dtype[grad.dtype].append(grad)
    for dtype in sorted(by_dtype, key=str):
        grads = by_dtype[dtype]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(world)
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
