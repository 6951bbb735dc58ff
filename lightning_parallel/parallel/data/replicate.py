"""ZeRO stage 0: plain data parallelism for parameters that may be tensor-parallel DTensors. Pure torch.

Hand-written because torch's DDP does not take DTensor parameters: after the last backward of a step,
the local gradients are averaged over the dp group in flat buckets of 25 MB per dtype (DDP's size; one flat copy of
every gradient would double gradient memory).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.parallel.data.overlap import (
    DEFAULT_BUCKET_MB,
    BucketedReduction,
    Prepare,
    buckets_of,
    overlap_summary,
)
from lightning_parallel.parallel.data.sharding import DataParallelSharding, trainable
from lightning_parallel.parallel.dtensor import local, placed_like
from lightning_parallel.parallel.expert.apply import is_expert_param


def local_grads(params: Iterable[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """(parameter, its local gradient) for every parameter; a missing gradient becomes zeros (every rank must
    contribute the same layout), a DTensor one is placed like its parameter first (e.g. Partial over tp)."""
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad = placed_like(p, p.grad)
        out.append((p, local(p.grad)))
    return out


def all_reduce_gradients(
    params: Iterable[Tensor],
    group: dist.ProcessGroup,
    divide_by: int | None = None,
    wire: torch.dtype | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> None:
    """Average every parameter's (local) gradient over ``group`` in place; missing gradients count as 0.
    ``divide_by``: the sum's divisor when it is not the group's size (expert parameters: every data-parallel rank);
    ``wire``: the dtype the sum travels in (gradient compression); ``bucket_mb``: the gradients travel in flat
    buckets of about this size per dtype (a larger gradient alone), so the copies add one bucket, not a second
    set of gradients."""
    world = dist.get_world_size(group)
    divisor = world if divide_by is None else divide_by
    if world == 1 and divisor == 1:
        # nothing to average, but a gradient that tensor parallelism left Partial (a replicated weight fed by split
        # activations: a sequence-parallel norm, a LoRA factor) is summed over tp here, as in local_grads
        for p in params:
            if p.grad is not None:
                p.grad = placed_like(p, p.grad)
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
    for _, grad in local_grads(params):
        by_dtype[grad.dtype].append(grad)
    for dtype in sorted(by_dtype, key=str):
        for bucket in buckets_of(by_dtype[dtype], bucket_mb):
            _all_reduce_bucket(bucket, group, divisor, wire)


def _all_reduce_bucket(grads: list[Tensor], group: dist.ProcessGroup, divisor: int, wire: torch.dtype | None) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(divisor)
    if dist.get_world_size(group) > 1:
        sent = flat.to(wire) if wire not in (None, flat.dtype) else flat
        dist.all_reduce(sent, group=group)
        if sent is not flat:
            flat.copy_(sent)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class Replicate(DataParallelSharding):
    """Stage 0: every rank holds everything; gradients are averaged once per step."""

    stage = 0
    sharded = frozenset()
    comm_factor = 1.0
    summary = "nothing sharded, gradients averaged"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._overlap: dict[int, list[BucketedReduction]] = {}  # id(optimizer) -> its reductions

    def shard_optimizer(self, optimizer: Optimizer) -> None:
        super().shard_optimizer(optimizer)
        if not self.overlap_grad_reduce:
            return
        params = trainable(optimizer)
        kinds = [
            ([p for p in params if not is_expert_param(p)], self.group),
            ([p for p in params if is_expert_param(p)], self.expert_group),
        ]
        self._overlap[id(optimizer)] = [
            BucketedReduction(members, group, self.data_parallel_size, self.wire_dtype, self.bucket_mb)
            for members, group in kinds
            if members
        ]

    def overlap_stats(self) -> dict[str, int]:
        reductions = [r for rs in self._overlap.values() for r in rs]
        return overlap_summary(reductions)

    def before_last_backward(
        self, optimizer: Optimizer, only: list[nn.Parameter] | None = None, prepare: Prepare | None = None
    ) -> None:
        for reduction in self._overlap.get(id(optimizer), []):
            reduction.arm(only, prepare)

    def arm_more(self, optimizer: Optimizer, params: list[nn.Parameter], ready: bool = False) -> None:
        for reduction in self._overlap.get(id(optimizer), []):
            reduction.arm_more(params, ready)

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        overlapped = [r.finish() for r in self._overlap.get(id(optimizer), [])]
        if overlapped and all(overlapped):
            return  # reduced bucket by bucket during backward
        params = trainable(optimizer)
        plain = [p for p in params if not is_expert_param(p)]
        if self.powersgd is not None:  # matrices as low-rank factors, the rest whole (powersgd.py; ep=1 only)
            self.powersgd.reduce(local_grads(plain), self.group, self.data_parallel_size)
        else:
            all_reduce_gradients(plain, self.group, wire=self.wire_dtype)
        experts = [p for p in params if is_expert_param(p)]
        if experts:
            divisor = self.data_parallel_size
            all_reduce_gradients(experts, self.expert_group, divide_by=divisor, wire=self.wire_dtype)
