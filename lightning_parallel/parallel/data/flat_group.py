"""One optimizer group's parameters packed into one flat buffer, and this rank's slice of it (ZeRO 1 and 2: see
:mod:`~lightning_parallel.parallel.data.flat_zero`). Pure torch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

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
