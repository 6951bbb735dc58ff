"""One optimizer group's parameters packed into one flat buffer, and this rank's slice of it (ZeRO 1 and 2: see
:mod:`~lightning_parallel.parallel.data.flat_zero`); and the sets of flat groups one collective serves. Pure torch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel._compat import all_gather_single, reduce_scatter_single
from lightning_parallel.parallel.data.offload import HostSlice
from lightning_parallel.parallel.dtensor import local

# State entries that are one number per parameter rather than one per element.
SCALAR_STATE_KEYS = frozenset({"step", "eta", "mu", "mu_product"})


@dataclass
class FlatGroup:
    """One optimizer group's parameters packed into one flat buffer, and this rank's slice of it. A group with
    expert parameters (split over ep) has a second flat group for them, sharded over the ranks holding the same
    experts."""

    params: list[nn.Parameter]  # trainable model parameters, in group order
    offsets: list[int]  # start of each parameter in the flat buffer
    shard_numel: int  # padded numel / world size
    flat_param: Tensor  # (shard_numel * N,) the model parameters are views into it
    flat_grad: Tensor | None  # stage 1: (shard_numel * N,) full gradients; stage 2: None
    shard: Tensor  # the optimizer's parameter: this rank's slice (``host.param`` under offload)
    group: dist.ProcessGroup | None = None  # the ranks the buffer is sharded over
    rank: int = 0  # this rank's index in it
    divisor: int = 1  # what the summed gradients are divided by (every data-parallel rank)
    expert: bool = False
    host: HostSlice | None = None  # offload: this rank's slice and its gradient on the host
    plain: bool = False  # no DTensor among the parameters: their gradients are whole local tensors
    grad_views: list[Tensor] | None = None  # stage 1, plain: each parameter's .grad, a view of flat_grad

    @property
    def world(self) -> int:
        """The number of ranks the buffer is sharded over."""
        return self.flat_param.numel() // self.shard_numel

    def local_range(self, rank: int | None = None) -> tuple[int, int]:
        rank = self.rank if rank is None else rank
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, flat: Tensor) -> Iterator[tuple[nn.Parameter, Tensor]]:
        for p, off in zip(self.params, self.offsets):
            shard = local(p)
            yield p, flat[off : off + shard.numel()].view(shard.shape)


def pack(params: list[nn.Parameter], world: int) -> tuple[list[int], int, Tensor]:
    locals_ = [local(p) for p in params]
    devices = {t.device for t in locals_}
    dtypes = {t.dtype for t in locals_}
    if len(devices) > 1 or len(dtypes) > 1:
        raise ValueError(
            f"ZeRO packs each optimizer group into one buffer, but a group mixes devices {devices} or dtypes "
            f"{dtypes}: put parameters of different devices or dtypes into separate param groups."
        )
    offsets, total = [], 0
    for t in locals_:
        offsets.append(total)
        total += t.numel()
    shard_numel = -(-total // world)
    flat = torch.zeros(shard_numel * world, dtype=locals_[0].dtype, device=locals_[0].device)
    for t, off in zip(locals_, offsets):
        flat[off : off + t.numel()].copy_(t.detach().reshape(-1))
    return offsets, shard_numel, flat


def comm_sets(groups: list[FlatGroup], limit_mb: float | None) -> list[list[FlatGroup]]:
    """``groups`` cut into the sets that one collective each serves: members share the process group, the divisor,
    the dtype and the device, in their order; with ``limit_mb``, a set grows to at most that many MB (a larger group
    alone), since merging copies its members into one buffer, and a collective that large is bandwidth-bound
    already. Every rank of a group cuts the same sets (the layout is the same on all)."""
    by_key: dict[tuple, list[list[FlatGroup]]] = {}
    limit = float("inf") if limit_mb is None else limit_mb * 2**20
    for fg in groups:
        key = (id(fg.group), fg.divisor, fg.flat_param.dtype, fg.flat_param.device)
        runs = by_key.setdefault(key, [[]])
        nbytes = fg.flat_param.numel() * fg.flat_param.element_size()
        size = sum(g.flat_param.numel() * g.flat_param.element_size() for g in runs[-1])
        if runs[-1] and size + nbytes > limit:
            runs.append([])
        runs[-1].append(fg)
    return [run for runs in by_key.values() for run in runs]


def rank_major(flats: list[Tensor], world: int) -> Tensor:
    """Flat buffers of several groups, each ``world`` equal chunks, as one buffer whose chunk ``r`` holds every
    group's chunk ``r`` in order: what one reduce-scatter or all-gather over all of them needs."""
    return torch.cat([f.view(world, -1) for f in flats], dim=1).view(-1)


def all_gather_set(groups: list[FlatGroup]) -> None:
    """Every rank's slice of each of ``groups`` gathered into its ``flat_param`` by one all-gather: this rank's slices
    copied into one buffer, gathered rank-major (:func:`rank_major`), copied out by one batched copy."""
    world = groups[0].world
    mine = torch.cat([fg.flat_param[slice(*fg.local_range())] for fg in groups])
    whole = mine.new_empty(mine.numel() * world)
    all_gather_single(whole, mine, group=groups[0].group)
    sources = list(whole.view(world, -1).split([fg.shard_numel for fg in groups], dim=1))
    torch._foreach_copy_([fg.flat_param.view(world, -1) for fg in groups], sources)


def grad_storage(groups: list[FlatGroup]) -> Tensor:
    """Stage 1: one zeroed gradient buffer for ``groups`` (one collective's set), each one's ``flat_grad`` a view of
    it, and each plain parameter's ``.grad`` a view of that: autograd accumulates in place, so stage 1 needs no copy
    after backward; not for DTensors: a sequence-parallel gradient arrives Partial and would be added unreduced."""
    first = groups[0].flat_param
    storage = torch.zeros(sum(fg.flat_param.numel() for fg in groups), dtype=first.dtype, device=first.device)
    start = 0
    for fg in groups:
        fg.flat_grad = storage[start : start + fg.flat_param.numel()]
        start += fg.flat_param.numel()
        views = []
        for p, view in fg.views(fg.flat_grad):
            if not isinstance(p, DTensor):
                p.grad = view
            views.append(view)
        fg.grad_views = views if fg.plain else None
    return storage


def average(flat: Tensor, fg: FlatGroup, stage: int, wire: torch.dtype | None) -> Tensor:
    """``flat`` (one or more of ``fg``'s kind of buffers) divided by ``fg``'s divisor and summed over its group, sent
    as ``wire`` (gradient compression; None: its own dtype): stage 1 all-reduced in place (returned), stage 2
    reduce-scattered (this rank's chunk returned)."""
    flat.div_(fg.divisor)  # divide first: the sum stays in range for low-precision gradients
    wire = wire if wire not in (None, flat.dtype) else None
    sent = flat.to(wire) if wire is not None else flat
    if stage == 1:
        dist.all_reduce(sent, group=fg.group)
        if wire is not None:
            flat.copy_(sent)
        return flat
    grad = torch.empty(sent.numel() // fg.world, dtype=sent.dtype, device=flat.device)
    reduce_scatter_single(grad, sent, group=fg.group)
    return grad.to(flat.dtype)
