"""Gradient-norm clipping over gradients that are split across process groups. Pure torch.

Hand-written because torch's ``clip_grad_norm_`` sees one rank's slice of a flat ZeRO shard as the whole
gradient, and Lightning clips each pipeline stage with its local norm. Here every local gradient says
which mesh axes split it; the partial sums of ``|g|^p`` are added over exactly those axes, so each
element is counted once, and the result is the norm of the full, unsplit gradient.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.devices import collective_device

# A local gradient and the names of the mesh axes it is split over ((): replicated).
GradPart = tuple[Tensor, tuple[str, ...]]


def total_norm(
    parts: Sequence[GradPart],
    groups: Mapping[str, dist.ProcessGroup],
    norm_type: float = 2.0,
    always_reduce: Sequence[tuple[str, ...]] = (),
) -> Tensor:
    """The norm of the full gradient that ``parts`` are pieces of.

    Args:
        parts: local gradients with the axes that split them.
        groups: the process group of every axis name used.
        norm_type: p of the p-norm; ``inf`` for the max norm.
        always_reduce: axis tuples to reduce over even when this rank has no gradient of that kind, so
            every rank issues the same collectives in the same order.
    """
    norm_type = float(norm_type)
    # partial norms are reduced where the groups' backend takes tensors (NCCL: this rank's GPU), also when the
    # gradients are on the host (offloaded) or this rank has none
    device = collective_device(next(iter(groups.values()))) if groups else torch.device("cpu")
    partial: dict[tuple[str, ...], Tensor] = defaultdict(lambda: torch.zeros((), device=device))
    # axes of one rank are left out (a reduction there changes nothing): fewer distinct sets, fewer collectives, and
    # the same on every rank, since group sizes are
    sized = {axis: dist.get_world_size(group) > 1 for axis, group in groups.items()}
    for axes in always_reduce:
        partial[tuple(a for a in axes if sized[a])]  # noqa: B018 -- creates the zero entry
    by_axes: dict[tuple[str, ...], list[Tensor]] = defaultdict(list)
    for g, axes in parts:
        by_axes[tuple(sorted(a for a in axes if sized[a]))].append(g)
    for axes, grads in by_axes.items():
        norms = torch._foreach_norm([g.float() for g in grads], norm_type)
        stacked = torch.stack([n.to(device) for n in norms])
        partial[axes] = stacked.max() if norm_type == float("inf") else stacked.pow(norm_type).sum()
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    keys = sorted(partial)
    if not keys:
        return torch.zeros((), device=device)
    values = torch.stack([partial[k] for k in keys])
    _reduce_partials(values, keys, groups, op)
    total = torch.zeros((), device=device)
    for value in values.unbind():
        total = torch.maximum(total, value) if norm_type == float("inf") else total + value
    return total if norm_type == float("inf") else total.pow(1.0 / norm_type)


def _reduce_partials(
    values: Tensor, keys: list[tuple[str, ...]], groups: Mapping[str, dist.ProcessGroup], op: dist.ReduceOp
) -> None:
    """Each partial norm in ``values`` reduced in place over the axes of its key: one collective per axis for all
    the partials that axis splits (several scalars in one collective), not one per partial and axis."""
    for axis in sorted({a for k in keys for a in k}):
        rows = [i for i, k in enumerate(keys) if axis in k]
        if len(rows) == len(keys):
            dist.all_reduce(values, op=op, group=groups[axis])
            continue
        picked = values[rows]
        dist.all_reduce(picked, op=op, group=groups[axis])
        values[rows] = picked


def clip_grad_norm_(
    parts: Sequence[GradPart],
    max_norm: float,
    groups: Mapping[str, dist.ProcessGroup],
    norm_type: float = 2.0,
    always_reduce: Sequence[tuple[str, ...]] = (),
    uncounted: Sequence[Tensor] = (),
) -> Tensor:
    """Scale the local gradients in place so the full gradient's norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_``, so a single-process run clips identically.
    ``uncounted`` gradients are scaled too but not counted: copies of a weight counted on another rank.

    Returns:
        The total norm before clipping.
    """
    norm = total_norm(parts, groups, norm_type, always_reduce)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [g for g, _ in parts] + list(uncounted)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
