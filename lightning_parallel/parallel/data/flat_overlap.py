"""ZeRO 1 and 2 overlapped with compute: gradients reduced bucket by bucket during backward, and the updated
parameters gathered bucket by bucket after the step, each waited for just before the forward uses it. Pure torch.

A bucket is a contiguous range of one flat group's buffer (:class:`~.flat_group.FlatGroup`): whole parameters,
cut in reverse order (backward produces the last layers' gradients first) into runs of about ``bucket_mb``; the
bucket at the end of the buffer also holds the padding. The flat layout, each rank owning one contiguous range,
is the one the non-overlapped path and the checkpoints use: nothing about it changes.

- Stage 1: the gradients are views into ``flat_grad``; a complete bucket's range of it is divided by the
  data-parallel size and all-reduced in place (a copy when compressed), as the whole buffer is without overlap.
- Stage 2: a complete bucket's gradients are added into a fresh buffer of the range and freed at once (ZeRO-2's
  point); the buffer is divided, and each piece of it that falls in a rank's range is reduced to that rank: one
  or two pieces per bucket. Why not an even reduce-scatter per bucket: it needs every rank's piece the same
  size, and buckets cut at even splits of every rank's range would each hold gradients from both ends of the
  model, complete only at the end of backward (at w ranks all of them within the last 1/w of it); an all-reduce
  of the bucket and a local slice would carry twice the bytes. The reduces carry the reduce-scatter's payload;
  in a pipelined chain every rank but the owner sends each piece once, (w-1)/w of it per rank as in the ring
  (``ShardGradients.comm_factor`` holds; ``comm_volume`` books a reduce at its whole payload per rank, w/(w-1)
  more).
- After the step (both stages), each bucket's pieces go out from their owners, async, first layers first (the
  non-overlapped path all-gathers the whole buffer). A forward pre-hook on every layer (the units ZeRO-3 would
  make: the repeated blocks, the other top-level children, the root) that holds parameters of a bucket waits for
  that bucket; ``settle()`` waits for everything still in flight and is called before the next reduction and the
  step, before checkpoints are written or read, and at the end of fit. The values are copies: bitwise the
  all-gather's.
- How the pieces travel depends on the backend (:func:`piece_collectives`). NCCL: one ``reduce_scatter`` and one
  ``all_gather`` per bucket with a piece per rank (empty for ranks owning none), which NCCL runs as one grouped
  launch of the owners' reduces and broadcasts, or the even ``reduce_scatter_single`` / ``all_gather_single``
  when a bucket splits evenly over every rank; gloo: one ``reduce`` and one ``broadcast`` per piece (gloo refuses
  an uneven ``all_gather``). The same sums either way: bitwise at 2 ranks, within float rounding at more.

The sums are elementwise those of the non-overlapped reduction (the same additions into zeros, the same division
before the collective): bitwise equal at 2 ranks; at more, a ring orders each element's additions by where it
sits in the buffer, so within float rounding of the one flat collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_parallel._compat import all_gather_single, reduce_scatter_single
from lightning_parallel.parallel.data.flat_group import FlatGroup
from lightning_parallel.parallel.data.overlap import HookedBuckets, buckets_of, overlap_summary
from lightning_parallel.parallel.dtensor import like, local, placed_like

Piece = tuple[int, int, int]  # (owner's rank in the group, lo, hi) in the flat buffer


@dataclass(frozen=True)
class PieceCollectives:
    """How a bucket's pieces (one per owning rank) travel."""

    reduce_scatter: bool  # gradients: one reduce_scatter per bucket (else one reduce per piece)
    all_gather: bool  # parameters: one all_gather per bucket (else one broadcast per piece)


def serving_backend(backend: str, device_type: str) -> str:
    """The backend that serves ``device_type`` tensors in a group's backend string (``dist.get_backend``):
    ``"nccl"``, ``"gloo"`` or a per-device list such as ``"cpu:gloo,cuda:nccl"``; ``""`` when none does."""
    if ":" not in backend:
        return backend.strip().lower()
    for entry in backend.split(","):
        device, _, name = entry.partition(":")
        if device.strip().lower() == device_type:
            return name.strip().lower()
    return ""


def piece_collectives(backend: str, device_type: str) -> PieceCollectives:
    """The collectives a group with ``backend`` runs a bucket's pieces on ``device_type`` with: one grouped call
    per bucket on NCCL (its uneven ``reduce_scatter`` / ``all_gather`` are one launch of grouped reduces and
    broadcasts); per-piece ``reduce`` / ``broadcast`` on gloo and anything else (gloo's ``all_gather`` refuses
    uneven pieces)."""
    grouped = serving_backend(backend, device_type) == "nccl"
    return PieceCollectives(reduce_scatter=grouped, all_gather=grouped)


def even(pieces: list[Piece], world: int) -> bool:
    """Whether a bucket's pieces split it evenly over all ``world`` ranks (an even collective then fits)."""
    return len(pieces) == world and len({b - a for _, a, b in pieces}) == 1


class FlatBuckets(HookedBuckets):
    """One flat group's gradients reduced, and its parameters gathered, bucket by bucket.

    Args:
        fg: the flat group (its buffers, offsets, group and this rank's range).
        stage: 1 (gradients all-reduced into ``flat_grad``) or 2 (reduced to their owners, then freed).
        wire: the dtype the gradients travel in (gradient compression), None for their own.
        bucket_mb: bucket size in MB.
        deliver: takes this rank's reduced gradient slice once every bucket is in (default: it becomes the
            optimizer parameter's ``.grad``).
    """

    def __init__(
        self,
        fg: FlatGroup,
        stage: int,
        wire: torch.dtype | None,
        bucket_mb: float,
        deliver: Callable[[Tensor], None] | None = None,
    ) -> None:
        super().__init__(buckets_of(fg.params, bucket_mb))
        self.fg, self.stage = fg, stage
        self.deliver = deliver if deliver is not None else (lambda grad: setattr(fg.shard, "grad", grad))
        self.world = dist.get_world_size(fg.group)
        self.collectives = piece_collectives(dist.get_backend(fg.group), fg.flat_param.device.type)
        offset = {id(p): off for p, off in zip(fg.params, fg.offsets)}
        self.wire = wire if wire not in (None, fg.flat_param.dtype) else None
        self.ranges = []  # each bucket's [lo, hi) in the flat buffer
        for params in self.bucket_params:
            lo = min(offset[id(p)] for p in params)
            hi = max(offset[id(p)] + local(p).numel() for p in params)
            self.ranges.append((lo, hi))
        last = max(range(len(self.ranges)), key=lambda i: self.ranges[i][1])
        self.ranges[last] = (self.ranges[last][0], fg.flat_param.numel())  # the padding travels with the end
        # per launched bucket: its buffer, what travels, the works, and this rank's piece of the sum (lo, tensor)
        self._sent: list[tuple[Tensor, Tensor, list[dist.Work], tuple[int, Tensor] | None] | None] = [None] * len(
            self.ranges
        )
        self._gathers: list[list[dist.Work]] = [[] for _ in self.ranges]
        self.waited_in_forward = 0  # gathers a forward pre-hook waited for, over the run (observability, tests)

    def pieces(self, index: int) -> list[Piece]:
        """(owner's rank in the group, lo, hi) of every piece of bucket ``index`` in one rank's range."""
        lo, hi = self.ranges[index]
        n, out = self.fg.shard_numel, []
        for owner in range(lo // n, -(-hi // n)):
            a, b = max(lo, owner * n), min(hi, (owner + 1) * n)
            if a < b:
                out.append((owner, a, b))
        return out

    # ----- gradients -----

    def _launch(self, index: int) -> None:
        fg, (lo, hi) = self.fg, self.ranges[index]
        params = self.bucket_params[index]
        if self.stage == 1:
            assert fg.flat_grad is not None
            flat = fg.flat_grad[lo:hi]
        else:
            flat = torch.zeros(hi - lo, dtype=fg.flat_param.dtype, device=fg.flat_param.device)
        base = fg.flat_grad if self.stage == 1 else None
        for p, view in self._views(params, flat, lo):
            if p.grad is not None and local(p.grad).data_ptr() != view.data_ptr():
                view.add_(local(placed_like(p, p.grad)))  # a gradient autograd allocated itself
            p.grad = like(p, view) if base is not None else None  # stage 2: the full gradient is freed
        flat.div_(fg.divisor)  # divide first: the sum stays in range for low-precision gradients
        sent = flat.to(self.wire) if self.wire is not None else flat
        if self.stage == 1:
            works, mine = [dist.all_reduce(sent, group=fg.group, async_op=True)], None
        else:
            works, mine = self._reduce_pieces(index, sent)
        self._sent[index] = (flat, sent, works, mine)

    def _reduce_pieces(self, index: int, sent: Tensor) -> tuple[list[dist.Work], tuple[int, Tensor] | None]:
        """Stage 2: each piece of bucket ``index`` (``sent``) reduced to its owner. Returns the works, and where
        this rank's piece of the sum will be once they are done: (its start in the flat buffer, the tensor)."""
        fg, lo, pieces = self.fg, self.ranges[index][0], self.pieces(index)
        mine = next(((a, sent[a - lo : b - lo]) for owner, a, b in pieces if owner == fg.rank), None)
        if not self.collectives.reduce_scatter:
            works = [
                dist.reduce(sent[a - lo : b - lo], group_dst=owner, group=fg.group, async_op=True)
                for owner, a, b in pieces
            ]
            return works, mine
        inputs = [sent[:0]] * self.world  # a rank owning nothing of this bucket gets an empty piece
        for owner, a, b in pieces:
            inputs[owner] = sent[a - lo : b - lo]
        out = torch.empty_like(inputs[fg.rank])
        if even(pieces, self.world):  # the bucket is the concatenation of the pieces, in rank order
            work = reduce_scatter_single(out, sent, group=fg.group, async_op=True)
        else:
            work = dist.reduce_scatter(out, inputs, group=fg.group, async_op=True)
        return [work], (mine[0], out) if mine is not None else None

    def _views(self, params: list[nn.Parameter], flat: Tensor, lo: int) -> Iterable[tuple[nn.Parameter, Tensor]]:
        offsets = dict(zip(map(id, self.fg.params), self.fg.offsets))
        for p in params:
            shard = local(p)
            start = offsets[id(p)] - lo
            yield p, flat[start : start + shard.numel()].view(shard.shape)

    def _complete(self) -> None:
        fg = self.fg
        start, end = fg.local_range()
        if self.stage == 1:
            assert fg.flat_grad is not None
            grad = fg.flat_grad[start:end]  # the views were averaged in place, bucket by bucket
        else:
            grad = torch.empty(end - start, dtype=fg.flat_param.dtype, device=fg.flat_param.device)
        for index in range(len(self.ranges)):
            entry = self._sent[index]
            assert entry is not None
            flat, sent, works, mine = entry
            for work in works:
                work.wait()
            self._waited(index, works)
            if self.stage == 1:
                if sent is not flat:
                    flat.copy_(sent)
            elif mine is not None:
                a, piece = mine
                grad[a - start : a - start + piece.numel()].copy_(piece)
            self._sent[index] = None
        self.deliver(grad)  # offload: onto the host, where the step runs (FlatZero._deliver)

    # ----- parameters -----

    def gather(self) -> None:
        """After the step: each bucket's pieces sent from their owners to every rank, first layers first (async)."""
        self.settle()
        for index in sorted(range(len(self.ranges)), key=lambda i: self.ranges[i][0]):
            self._gathers[index] = self._gather_pieces(index)

    def _gather_pieces(self, index: int) -> list[dist.Work]:
        fg, (lo, hi), pieces = self.fg, self.ranges[index], self.pieces(index)
        flat = fg.flat_param
        if not self.collectives.all_gather:
            return [dist.broadcast(flat[a:b], group_src=owner, group=fg.group, async_op=True) for owner, a, b in pieces]
        outputs = [flat[lo:lo]] * self.world  # a rank owning nothing of this bucket sends an empty piece
        for owner, a, b in pieces:
            outputs[owner] = flat[a:b]
        if even(pieces, self.world):  # the input is copied because it aliases the output buffer
            return [all_gather_single(flat[lo:hi], outputs[fg.rank].clone(), group=fg.group, async_op=True)]
        return [dist.all_gather(outputs, outputs[fg.rank], group=fg.group, async_op=True)]

    def wait_gather(self, index: int) -> None:
        works, self._gathers[index] = self._gathers[index], []
        for work in works:
            work.wait()

    def settle(self) -> None:
        """Wait for every parameter gather still in flight."""
        for index in range(len(self._gathers)):
            self.wait_gather(index)

    def wait_before_forward(self, root: nn.Module, units: list[str]) -> list[RemovableHandle]:
        """A forward pre-hook on each of ``root``'s ``units`` (module paths, ``""`` the root: the layers, as ZeRO-3
        would cut them) holding parameters of these buckets: it waits for the gathers of the parameters its forward
        reads, those of its subtree that no unit nested in it holds. Hooks sit on whole layers, outside a compiled
        layer's forward."""
        handles = []
        for path in units:
            module = root.get_submodule(path)
            nested = [u for u in units if u != path and (path == "" or u.startswith(path + "."))]
            inner = {id(p) for u in nested for p in root.get_submodule(u).parameters()}
            reads = [p for p in module.parameters() if id(p) in self._index and id(p) not in inner]
            mine = sorted({self._index[id(p)] for p in reads})
            if mine:
                handles.append(module.register_forward_pre_hook(self._pre_forward(mine)))
        return handles

    def _pre_forward(self, indices: list[int]):  # noqa: ANN202
        def hook(module: nn.Module, args: object) -> None:
            for index in indices:
                if self._gathers[index]:
                    self.wait_gather(index)
                    self.waited_in_forward += 1

        return hook


def flat_overlap_stats(buckets: list[FlatBuckets]) -> dict[str, int]:
    """:func:`~.overlap.overlap_summary`, and how many parameter gathers a layer's forward waited for over the run."""
    stats = overlap_summary(buckets)
    if buckets:
        stats["gathers_waited_in_forward"] = sum(b.waited_in_forward for b in buckets)
    return stats
