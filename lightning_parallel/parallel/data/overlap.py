"""Gradient reduction overlapped with backward: buckets of gradients all-reduced as soon as backward has produced
them (DDP's reducer, Megatron's ``overlap_grad_reduce``). Pure torch.

Each trainable parameter gets a post-accumulate-grad hook. The parameters are cut into buckets of about
``bucket_mb`` megabytes in reverse order (backward produces the last layers' gradients first); when every
parameter of a bucket has its gradient, the bucket's gradients are copied into one flat buffer, divided by the
data-parallel size, cast to the compression dtype if any, and all-reduced with ``async_op=True`` while backward goes
on. :meth:`BucketedReduction.finish` launches the buckets whose gradients never came (unused parameters count as
zero, as in the non-overlapped path), waits for all of them and copies the averages back into the gradients, before
clipping and the step. The hooks only act while armed: the strategy arms them for the last backward of an
optimizer step (not for the micro-steps of gradient accumulation, whose gradients must first add up).

The sums are the same elementwise sums as one flat all-reduce after backward: bitwise equal at 2 ranks (a + b),
equal up to the order of a ring's additions at more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.parallel.dtensor import local, placed_like

DEFAULT_BUCKET_MB = 25.0  # DDP's default


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)
    flat: Tensor | None = None
    wire: Tensor | None = None
    work: dist.Work | None = None


def buckets_of(params: Sequence[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """``params`` in reverse order cut into runs of at most ``bucket_mb`` MB (a larger parameter alone)."""
    limit = bucket_mb * 2**20
    out: list[list[nn.Parameter]] = []
    size = 0.0
    for p in reversed(list(params)):
        nbytes = local(p).numel() * local(p).element_size()
        if not out or size + nbytes > limit:
            out.append([])
            size = 0.0
        out[-1].append(p)
        size += nbytes
    return out


class BucketedReduction:
    """Averages the gradients of ``params`` over ``group`` bucket by bucket during backward.

    Args:
        params: the trainable parameters whose gradients meet over ``group``.
        group: the data-parallel process group.
        divisor: what the sums are divided by (the data-parallel size).
        wire: the dtype the buckets travel in (gradient compression), None for their own.
        bucket_mb: bucket size in MB.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup,
        divisor: int,
        wire: torch.dtype | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> None:
        self.group, self.divisor, self.wire = group, divisor, wire
        self.buckets = [_Bucket(ps) for ps in buckets_of(params, bucket_mb)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.armed = False
        self.launched = 0  # buckets launched during backward in the last step (observability and tests)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params]

    def arm(self) -> None:
        """The next backward is the last of the optimizer step: reduce its gradients as they come."""
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.flat = bucket.wire = bucket.work = None
        self.launched = 0
        self.armed = True

    def _on_grad(self, p: Tensor) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params) and bucket.work is None:
            self._launch(bucket)
            self.launched += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank contributes the same layout: a missing gradient is 0
            p.grad = placed_like(p, p.grad)
            grads.append(local(p.grad))
        bucket.flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.divisor)
        bucket.wire = bucket.flat.to(self.wire) if self.wire not in (None, bucket.flat.dtype) else bucket.flat
        bucket.work = dist.all_reduce(bucket.wire, group=self.group, async_op=True)

    def finish(self) -> bool:
        """Launch what backward left, wait for every bucket and write the averages into the gradients. Returns
        False when not armed (the caller reduces the usual way)."""
        if not self.armed:
            return False
        self.armed = False
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            assert bucket.work is not None and bucket.flat is not None and bucket.wire is not None
            bucket.work.wait()
            if bucket.wire is not bucket.flat:
                bucket.flat.copy_(bucket.wire)
            offset = 0
            for p in bucket.params:
                g = local(p.grad)
                g.copy_(bucket.flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket.flat = bucket.wire = bucket.work = None
        return True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def overlap_summary(reductions: Sequence[BucketedReduction]) -> dict[str, int]:
    """Buckets in all, and how many the last step launched during backward (the rest waited for ``finish``)."""
    if not reductions:
        return {}
    buckets = sum(len(r.buckets) for r in reductions)
    return {"buckets": buckets, "launched_in_backward": sum(r.launched for r in reductions)}
