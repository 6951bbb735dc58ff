"""Where each parameter lives in the flat vector the servers shard, and the server's optimizer on its shard.

The flat vector is the optimizer's parameters group by group (each group's parameters in the optimizer's
order), so every param group is one contiguous segment; server ``i`` of ``n`` holds the contiguous range
``[i * N / n, (i + 1) * N / n)``, and one flat piece per param group that range meets. The server's optimizer is
the user's class with the user's group settings, on those pieces: for an element-wise optimizer (SGD, Adam,
AdamW, ...) that is exactly the update of the unsharded one. Pure torch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

# optimizers whose update of an element depends on that element alone (and its own state): a flat shard of the
# parameters steps exactly as the unsharded tensors would. Others (LBFGS: a line search over all parameters;
# Adafactor: row and column statistics of a matrix) would silently change meaning on a flat shard.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)


def check_optimizer(optimizer: Optimizer) -> None:
    if not isinstance(optimizer, ELEMENTWISE):
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE)
        raise TypeError(
            f"async_ps runs the optimizer of configure_optimizers on flat shards of the parameters, and "
            f"{type(optimizer).__name__} is not element-wise (its update of one element depends on others): use "
            f"one of {names}."
        )


@dataclass
class FlatLayout:
    """The parameters' places in the flat vector and the servers' ranges of it."""

    params: list[Tensor]  # in flat order
    offsets: list[int]  # start of each parameter
    group_of: list[int]  # the param group of each parameter
    group_bounds: list[tuple[int, int]]  # each group's [start, end)
    num_servers: int

    @classmethod
    def of(cls, optimizer: Optimizer, num_servers: int) -> FlatLayout:
        params, offsets, group_of, bounds, n = [], [], [], [], 0
        for g, group in enumerate(optimizer.param_groups):
            start = n
            for p in group["params"]:
                params.append(p)
                offsets.append(n)
                group_of.append(g)
                n += p.numel()
            bounds.append((start, n))
        return cls(params, offsets, group_of, bounds, num_servers)

    @property
    def numel(self) -> int:
        return self.group_bounds[-1][1] if self.group_bounds else 0

    def server_range(self, server: int) -> tuple[int, int]:
        n, s = self.numel, self.num_servers
        return server * n // s, (server + 1) * n // s

    def pieces(self, server: int) -> list[tuple[int, int, int]]:
        """``(group, start, end)`` of the flat pieces server ``server`` holds, one per param group it meets."""
        a, b = self.server_range(server)
        out = []
        for g, (start, end) in enumerate(self.group_bounds):
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                out.append((g, lo, hi))
        return out

    def flat_params(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params]) if self.params else torch.empty(0)

    def flat_grads(self) -> Tensor:
        """The gradients in flat order (zeros where a parameter got none)."""
        return torch.cat(
            [
                (p.grad.detach().reshape(-1).float() if p.grad is not None else torch.zeros(p.numel(), device=p.device))
                for p in self.params
            ]
        )

    def load(self, flat: Tensor, start: int = 0) -> None:
        """Copy ``flat`` (the slice of the flat vector that begins at ``start``) into the parameters it covers."""
        end = start + flat.numel()
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                lo, hi = max(off, start), min(off + p.numel(), end)
                if lo < hi:
                    p.view(-1)[lo - off : hi - off].copy_(flat[lo - start : hi - start])

    def names(self, module: nn.Module) -> list[str]:
        """The parameters' names in ``module``, in flat order."""
        by_id = {id(p): name for name, p in module.named_parameters()}
        return [by_id[id(p)] for p in self.params]


def shard_optimizer(optimizer: Optimizer, layout: FlatLayout, server: int) -> tuple[Optimizer, list[nn.Parameter]]:
    """The user's optimizer class and group settings on this server's flat pieces (initialised from the current
    parameters); returns it and the pieces (one ``nn.Parameter`` per param group the server's range meets)."""
    check_optimizer(optimizer)
    flat = layout.flat_params()
    pieces, groups = [], []
    for g, lo, hi in layout.pieces(server):
        piece = nn.Parameter(flat[lo:hi].clone())
        pieces.append(piece)
        settings = {k: v for k, v in optimizer.param_groups[g].items() if k != "params"}
        groups.append({**settings, "params": [piece], "user_group": g})
    if not groups:  # more servers than elements: an empty shard still answers
        piece = nn.Parameter(torch.empty(0))
        pieces.append(piece)
        groups.append({"params": [piece], "user_group": 0})
    # each group carries every setting; the constructor gets the defaults it takes (AdamW's defaults hold more)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults), pieces
