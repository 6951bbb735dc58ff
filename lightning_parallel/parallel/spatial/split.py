"""Images split into strips of rows over the spatial ranks, and the strips gathered again. Pure torch.

Rank ``r`` of ``S`` holds rows ``r * H/S`` to ``(r + 1) * H/S`` of every image (``shard_height``). Before the
classifier the strips are all-gathered back into whole feature maps (:func:`gather_strips`), so every spatial rank
runs the classifier on the whole images and gets the same loss.

Gradients: the classifier's parameters see the whole activations on every spatial rank, the convolutions and
BatchNorms only their strip's part of the gradient. The strategy averages every gradient over the ranks that share a
loss (dp x spatial), which would leave the strip parameters 1/S of the one-process gradient; so the gather's backward
hands this rank its rows of the gradient times S (``grad_scale``): the mean over dp x spatial of S x (strip parts)
is then the sum of the strip parts, the one-process gradient, and the classifier's mean of S equal copies is its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

HEIGHT = 2  # the dim of (B, C, H, W) that is split


def check_height(height: int, multiple: int, spatial: int, setting: str = "spatial") -> None:
    """A ValueError naming ``setting`` and the fix unless ``multiple`` (spatial x the model's downsampling before the
    classifier) divides ``height``."""
    if height % multiple:
        factor = multiple // spatial
        down = f" x the downsampling of the pools and strides before the classifier ({factor})" if factor > 1 else ""
        raise ValueError(
            f"{setting}={spatial} splits each image into {spatial} strips of equal height, kept aligned through every "
            f"pool and stride: the image height {height} must be a multiple of {setting}{down} = {multiple}. Use "
            f"images whose height is a multiple of {multiple} (model.image_size), or a {setting} that divides "
            f"{height // factor} (the feature maps' height at the classifier)."
        )


def shard_height(x: Tensor, spatial: int, rank: int) -> Tensor:
    """This rank's strip of (B, C, H, W) images: rows ``rank * H/S`` to ``(rank + 1) * H/S`` (a view)."""
    return x.chunk(spatial, dim=HEIGHT)[rank]


def unshard_height(strips: list[Tensor]) -> Tensor:
    """The inverse of :func:`shard_height`: every rank's strip (rank order) back into whole images."""
    return torch.cat(strips, dim=HEIGHT)


class _GatherStrips(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, grad_scale: float) -> Tensor:
        strips = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(strips, x.contiguous(), group=group)
        ctx.rank, ctx.height, ctx.grad_scale = dist.get_rank(group), x.shape[HEIGHT], grad_scale
        return torch.cat(strips, dim=HEIGHT)

    @staticmethod
    def backward(ctx, grad: Tensor):
        mine = grad.narrow(HEIGHT, ctx.rank * ctx.height, ctx.height)
        return mine * ctx.grad_scale, None, None


def gather_strips(x: Tensor, group: dist.ProcessGroup, grad_scale: float = 1.0) -> Tensor:
    """Every rank's strip of (B, C, h, W) feature maps, stacked in rank order: (B, C, S * h, W).

    Args:
        x: this rank's strip.
        group: the spatial ranks (strips of equal height).
        grad_scale: what this rank's rows of the gradient are multiplied by in backward (see the module docstring).
    """
    return _GatherStrips.apply(x, group, grad_scale)
