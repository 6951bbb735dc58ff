"""Weights tied across pipeline stages (GPT's embedding and head): gradients summed over the pp axis. Pure torch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_parallel._compat import local_tensor as _local
from lightning_parallel.parallel.devices import collective_device
from lightning_parallel.parallel.dtensor import like, placed_like


class TiedGradients:
    """Sums the gradients of weights tied across pipeline stages over the pp axis (collective).

    Every pp rank takes part in every tied group, with zeros where it holds no copy, so all ranks issue
    the same all-reduces. The copy on the lowest pp rank is the one gradient-norm code counts. A frozen tied weight
    (``requires_grad=False``: a LoRA base's embedding and head) has no gradient on any rank and is left alone: its
    copies never change, and giving them a zero gradient would make frozen weights look trained.
    """

    def __init__(self, root: nn.Module, tie_groups: list[list[str]], group: dist.ProcessGroup) -> None:
        self.root, self.group = root, group
        self.tie_groups = tie_groups
        self._shapes: list[tuple[torch.Size, torch.dtype] | None] | None = None  # None: a frozen group
        self._counted_elsewhere: set[int] = set()

    @property
    def device(self) -> torch.device:
        """Where the pp all-reduce of a tied gradient runs."""
        return collective_device(self.group)

    def _members(self, names: list[str]) -> list[nn.Parameter]:
        params = dict(self.root.named_parameters(remove_duplicate=False))
        found: dict[int, nn.Parameter] = {}
        for n in names:
            if n in params:
                found.setdefault(id(params[n]), params[n])
        return list(found.values())

    def local_entries(self) -> list[tuple[tuple[int, ...], torch.dtype, bool] | None]:
        """Per tied group: this rank's first copy's local shape, dtype and whether it is trained (None: no copy)."""
        mine = []
        for names in self.tie_groups:
            members = self._members(names)
            first = _local(members[0]) if members else None
            mine.append((tuple(first.shape), first.dtype, members[0].requires_grad) if first is not None else None)
        return mine

    def _agree(self) -> None:
        """Learn each group's local shape and which pp ranks hold it (once, after all sharding)."""
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, self.local_entries(), group=self.group)
        self.settle(everyone)

    def settle(self, everyone: list[Any]) -> None:
        """Given every pp rank's :meth:`local_entries` (in pp order): each group's shape, and the copies that
        another rank counts in norms."""
        rank = dist.get_rank(self.group)
        self._shapes = []
        for g, names in enumerate(self.tie_groups):
            holders = [r for r, entry in enumerate(everyone) if entry[g] is not None]
            shape, dtype, trained = everyone[holders[0]][g]
            self._shapes.append((torch.Size(shape), dtype) if trained else None)
            members = self._members(names)
            # count the weight once in norms: on the lowest holding rank, its first copy
            skip = members if rank != holders[0] else members[1:]
            self._counted_elsewhere.update(id(p) for p in skip)

    def params(self) -> list[nn.Parameter]:
        """This rank's tied parameters: their gradients are summed over pp before the data-parallel reduction."""
        return [p for names in self.tie_groups for p in self._members(names)]

    def excluded_from_norm(self) -> set[int]:
        """Ids of this rank's tied copies whose gradient another copy already counts."""
        if self._shapes is None:
            self._agree()
        return self._counted_elsewhere

    def reduce(self) -> None:
        if self._shapes is None:
            self._agree()
        assert self._shapes is not None
        for names, agreed in zip(self.tie_groups, self._shapes):
            if agreed is None:
                continue  # frozen on every rank: no gradient anywhere, nothing to sum
            shape, dtype = agreed
            members = self._members(names)
            # on the device the pp group's backend serves (NCCL: this rank's GPU), whether this rank holds a copy or
            # not (a middle stage at pp >= 3) and wherever its copies' gradients are (offloaded to the host)
            total = torch.zeros(shape, dtype=dtype, device=self.device)
            for p in members:
                if p.grad is not None:
                    total += _local(placed_like(p, p.grad)).to(self.device)
            dist.all_reduce(total, group=self.group)
            for p in members:
                grad = p.grad
                if grad is None or (isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements)):
                    p.grad = like(p, total.to(_local(p).device, copy=True))
                else:
                    _local(grad).copy_(total)  # in place: the gradient may be a view into a flat buffer
