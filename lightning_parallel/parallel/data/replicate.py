"""ZeRO stage 0: plain data parallelism for parameters that may be tensor-parallel DTensors. Pure torch.

Hand-written because torch's DDP does not take DTensor parameters: after the last backward of a step,
the local gradients are averaged over the dp group in flat buckets of 25 MB per dtype (DDP's size; one flat copy of
every gradient would double gradient memory).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from itertools import repeat
from operator import is_not
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel.parallel.data.overlap import (
    DEFAULT_BUCKET_MB,
    BucketedReduction,
    Prepare,
    buckets_of,
    overlap_summary,
)
from lightning_parallel.parallel.data.sharding import DataParallelSharding, register_sharding, trainable
from lightning_parallel.parallel.dtensor import local, placed_like
from lightning_parallel.parallel.expert.apply import is_expert_param
from lightning_parallel.parallel.optim.muon import is_muon


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


class GradientBuckets:
    """The gradients of ``params`` averaged over ``group`` in place, in flat buckets of about ``bucket_mb`` MB per
    dtype (a larger gradient alone; the copies add one bucket, not a second set of gradients), laid out once: a step
    does one flatten, one all-reduce and one batched copy back per bucket, as DDP's reducer does in C++, not a few
    Python calls per parameter. Missing gradients count as 0.

    Args:
        params: the parameters (plain tensors or DTensors: a DTensor's local gradient, placed like it, is reduced).
        group: the ranks the gradients meet over.
        divide_by: the sum's divisor when it is not the group's size (expert parameters: every data-parallel rank).
        wire: the dtype the sum travels in (gradient compression).
        bucket_mb: the bucket size.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        group: dist.ProcessGroup,
        divide_by: int | None = None,
        wire: torch.dtype | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> None:
        self.params = list(params)
        self.group, self.wire = group, wire
        self.world = dist.get_world_size(group)
        self.divisor = self.world if divide_by is None else divide_by
        self.split = any(isinstance(p, DTensor) for p in self.params)  # local gradients need placing first
        by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
        for p in self.params:
            by_dtype[p.dtype].append(p)
        self.buckets = [b for dtype in sorted(by_dtype, key=str) for b in buckets_of(by_dtype[dtype], bucket_mb)]

    def reduce(self) -> None:
        if self.world == 1 and self.divisor == 1:
            # nothing to average, but a gradient that tensor parallelism left Partial (a replicated weight fed by split
            # activations: a sequence-parallel norm, a LoRA factor) is summed over tp here, as in local_grads
            if self.split:
                for p in self.params:
                    if p.grad is not None:
                        p.grad = placed_like(p, p.grad)
            return
        for bucket in self.buckets:
            grads = None if self.split else [p.grad for p in bucket]
            if grads is None or not all(map(is_not, grads, repeat(None))):  # C calls only, none per gradient
                grads = [g for _, g in local_grads(bucket)]
            _all_reduce_bucket(grads, self.group, self.divisor, self.wire)


def all_reduce_gradients(params: Iterable[Tensor], group: dist.ProcessGroup, **settings: Any) -> None:
    """Average every parameter's (local) gradient over ``group`` in place, once; ``settings``: ``divide_by``,
    ``wire``, ``bucket_mb`` (:class:`GradientBuckets`)."""
    GradientBuckets(params, group, **settings).reduce()


def _all_reduce_bucket(grads: list[Tensor], group: dist.ProcessGroup, divisor: int, wire: torch.dtype | None) -> None:
    flat = _flatten_dense_tensors(grads).div_(divisor)  # one gradient alone: a view of it, reduced in place
    if dist.get_world_size(group) > 1:
        sent = flat.to(wire) if wire not in (None, flat.dtype) else flat
        dist.all_reduce(sent, group=group)
        if sent is not flat:
            flat.copy_(sent)
    torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))


@register_sharding("replicate")
class Replicate(DataParallelSharding):
    """Stage 0: every rank holds everything; gradients are averaged once per step."""

    stage = 0
    sharded = frozenset()
    comm_factor = 1.0
    supports_hsdp = False  # nothing is sharded, so there is nothing to replicate across replicas
    summary = "nothing sharded, gradients averaged"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._overlap: dict[int, list[BucketedReduction]] = {}  # id(optimizer) -> its reductions
        self._plans: dict[int, tuple[GradientBuckets, GradientBuckets | None]] = {}  # id(optimizer) -> its buckets

    def shard_optimizer(self, optimizer: Optimizer) -> None:
        super().shard_optimizer(optimizer)
        inner = getattr(optimizer, "_optimizer", optimizer)
        if is_muon(inner):  # the same whole matrices on every rank here: each orthogonalized by one owner
            inner.replica_group = self.group
        self._plans.pop(id(optimizer), None)  # a new optimizer (another fit) gets its own buckets
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
        plain, experts = self._reductions(optimizer)
        if self.powersgd is not None:  # matrices as low-rank factors, the rest whole (powersgd.py; ep=1 only)
            self.powersgd.reduce(local_grads(plain.params), self.group, self.data_parallel_size)
        else:
            plain.reduce()
        if experts is not None:
            experts.reduce()

    def _reductions(self, optimizer: Optimizer) -> tuple[GradientBuckets, GradientBuckets | None]:
        """The optimizer's plain and expert parameters' buckets, laid out at its first step (the trainable parameters
        then, as ZeRO 1-2 pack theirs when the optimizer is sharded)."""
        found = self._plans.get(id(optimizer))
        if found is None:
            params = trainable(optimizer)
            plain = GradientBuckets([p for p in params if not is_expert_param(p)], self.group, wire=self.wire_dtype)
            experts = [p for p in params if is_expert_param(p)]
            divisor = self.data_parallel_size
            expert = GradientBuckets(experts, self.expert_group, divisor, self.wire_dtype) if experts else None
            found = self._plans[id(optimizer)] = (plain, expert)
        return found
