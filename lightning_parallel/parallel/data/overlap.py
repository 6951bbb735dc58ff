"""Gradient reduction overlapped with backward: buckets of gradients reduced as soon as backward has produced them
(DDP's reducer, Megatron's ``overlap_grad_reduce``). Pure torch.

Each trainable parameter gets a post-accumulate-grad hook. The parameters are cut into buckets of about
``bucket_mb`` megabytes in reverse order (backward produces the last layers' gradients first); when every armed
parameter of a bucket has its gradient, the bucket is launched: its gradients divided by the data-parallel size,
cast to the compression dtype if any, and reduced with ``async_op=True`` while backward goes on. ``finish()``
launches the buckets whose gradients never came (unused parameters count as zero, as in the non-overlapped path),
waits for all of them and puts the averages where the step reads them, before clipping and the step.

The hooks only act on armed parameters, and only once a step: the strategy arms every parameter for the last
backward of an optimizer step (not for the micro-steps of gradient accumulation, whose gradients must first add
up); under a pipeline it arms each stage's parameters just before the backward of that stage's last microbatch
(the weight-gradient half under zero-bubble schedules), with a ``prepare`` callback that first adds the gradients
of the earlier accumulation micro-steps, exactly as the step would after the schedule.

:class:`BucketedReduction` (ZeRO 0) all-reduces a bucket's gradients in one flat copy;
:mod:`~lightning_parallel.parallel.data.flat_overlap` (ZeRO 1 and 2) buckets ranges of the flat buffers. Both are
the same elementwise sums as the reduction after backward: bitwise equal at 2 ranks (a + b); at more, a ring adds
in an order that depends on where an element sits in the buffer, so equal bitwise to the same buckets reduced
after backward and within float rounding of one flat reduction. While a timeline recorder is active
(:mod:`~lightning_parallel.parallel.measure.timeline`), each bucket is recorded from its launch to the end of
its collective (kind ``"reduce"``): host clocks on the CPU, CUDA events on a GPU (:func:`record_waited`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.parallel.dtensor import local, placed_like
from lightning_parallel.parallel.measure.timeline import active_recorder

DEFAULT_BUCKET_MB = 25.0  # DDP's default

Prepare = Callable[[nn.Parameter], None]


@dataclass
class Launched:
    """A bucket's collective was launched; ``mark``: when, on the active timeline's clock (None: none records)."""

    mark: Any = None


def launch_mark() -> Launched:
    """Mark a bucket's launch: on a recording timeline's clock (on CUDA an event on the current stream, which the
    process group's stream passes before it starts the collective), nothing otherwise."""
    recorder = active_recorder()
    return Launched(recorder.mark() if recorder is not None else None)


def record_waited(index: int, launched: Launched, works: Sequence[dist.Work], device: torch.device) -> None:
    """Bucket ``index``'s ``works`` were just waited for: its bar onto the recording timeline, if any, from its
    launch to the end of its collective.

    On the CPU (gloo) ``wait()`` blocked the host until the collective ended: now is its end. On CUDA ``wait()`` only
    makes the current stream wait for the process group's, so host clocks around it measure nothing: the end is an
    event recorded on a side stream made to wait for the works, which completes when the collective does."""
    recorder = active_recorder()
    if recorder is None or launched.mark is None:
        return
    if device.type == "cuda":
        with torch.cuda.stream(torch.cuda.Stream(device)):
            for work in works:
                work.wait()
            end = recorder.mark()
    else:
        end = recorder.mark()
    recorder.add("reduce", -1, index, launched.mark, end)


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


class HookedBuckets:
    """The hooks, the arming and the bookkeeping every overlapped reduction shares; subclasses launch a bucket
    (``_launch(index)``) and complete them all (``_complete()``).

    Args:
        buckets: the parameters of each bucket, in the order backward completes them.
    """

    def __init__(self, buckets: Sequence[Sequence[nn.Parameter]]) -> None:
        self.bucket_params = [list(ps) for ps in buckets]
        self._index = {id(p): i for i, ps in enumerate(self.bucket_params) for p in ps}
        self._ready: list[set[int]] = [set() for _ in self.bucket_params]
        self._started: list[Launched | None] = [None] * len(self.bucket_params)  # None: not launched
        first = next((local(p) for ps in self.bucket_params for p in ps), None)
        self.device = first.device if first is not None else torch.device("cpu")  # where the gradients are
        self._armed: set[int] = set()
        self._prepare: Prepare | None = None
        self.active = False  # between arm() and finish(): finish() reduces
        self.launched = 0  # buckets launched during backward in the last step (observability and tests)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for ps in self.bucket_params for p in ps]

    def arm(self, only: Collection[nn.Parameter] | None = None, prepare: Prepare | None = None) -> None:
        """A step's last backward comes: reduce the gradients of ``only`` (None: every parameter) as they come.
        ``prepare(p)`` runs on each armed parameter's gradient before it joins its bucket."""
        for ready in self._ready:
            ready.clear()
        self._started = [None] * len(self.bucket_params)
        self._armed = set(self._index) if only is None else {id(p) for p in only if id(p) in self._index}
        self._prepare, self.launched, self.active = prepare, 0, True

    def arm_more(self, params: Collection[nn.Parameter], ready: bool = False) -> None:
        """Arm ``params`` too (a pipeline stage about to run its last backward); ``ready``: their gradients are
        complete now, whether or not their hooks ran (torch's weight-only backward assigns ``.grad`` itself)."""
        if not self.active:
            return
        mine = [p for p in params if id(p) in self._index]
        if not ready:
            self._armed.update(id(p) for p in mine)
            return
        for p in mine:
            if id(p) in self._armed:
                self._on_grad(p)

    def _on_grad(self, p: Tensor) -> None:
        if id(p) not in self._armed:
            return
        self._armed.discard(id(p))  # once a step: its gradient is complete now
        if self._prepare is not None:
            self._prepare(p)
        index = self._index[id(p)]
        self._ready[index].add(id(p))
        if len(self._ready[index]) == len(self.bucket_params[index]) and self._started[index] is None:
            self._start(index)
            self.launched += 1

    def _start(self, index: int) -> None:
        self._started[index] = launch_mark()
        self._launch(index)

    def finish(self) -> bool:
        """Launch what backward left, wait for every bucket and put the averages where the step reads them.
        Returns False when not armed (the caller reduces the usual way)."""
        if not self.active:
            return False
        self.active, self._armed, self._prepare = False, set(), None
        for index, started in enumerate(self._started):
            if started is None:
                self._start(index)
        self._complete()
        return True

    def _waited(self, index: int, works: Sequence[dist.Work]) -> None:
        """Bucket ``index``'s ``works`` have been waited for: onto the timeline, if one is recording."""
        launched = self._started[index]
        if launched is not None:
            record_waited(index, launched, works, self.device)

    def _launch(self, index: int) -> None:
        raise NotImplementedError

    def _complete(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class BucketedReduction(HookedBuckets):
    """Averages the gradients of ``params`` over ``group`` bucket by bucket during backward (ZeRO 0).

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
        super().__init__(buckets_of(params, bucket_mb))
        self.group, self.divisor, self.wire = group, divisor, wire
        self._flat: list[tuple[Tensor, Tensor, dist.Work] | None] = [None] * len(self.bucket_params)

    @property
    def buckets(self) -> list[list[nn.Parameter]]:
        return self.bucket_params

    def _launch(self, index: int) -> None:
        grads = []
        for p in self.bucket_params[index]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank contributes the same layout: a missing gradient is 0
            p.grad = placed_like(p, p.grad)
            grads.append(local(p.grad))
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.divisor)
        wire = flat.to(self.wire) if self.wire not in (None, flat.dtype) else flat
        self._flat[index] = (flat, wire, dist.all_reduce(wire, group=self.group, async_op=True))

    def _complete(self) -> None:
        for index, params in enumerate(self.bucket_params):
            entry = self._flat[index]
            assert entry is not None
            flat, wire, work = entry
            work.wait()
            self._waited(index, [work])
            if wire is not flat:
                flat.copy_(wire)
            offset = 0
            for p in params:
                g = local(p.grad)
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            self._flat[index] = None


def overlap_summary(reductions: Sequence[HookedBuckets]) -> dict[str, int]:
    """Buckets in all, and how many the last step launched during backward (the rest waited for ``finish``)."""
    if not reductions:
        return {}
    buckets = sum(len(r.bucket_params) for r in reductions)
    return {"buckets": buckets, "launched_in_backward": sum(r.launched for r in reductions)}
