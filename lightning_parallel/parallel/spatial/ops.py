"""The convolution and the BatchNorm of a strip, as autograd Functions that keep only what one process keeps for
backward. Pure torch.

A convolution on a strip reads halo rows from the neighbouring strips (:mod:`.halo`). Run as halo exchange, then
``F.conv2d``, autograd would keep the padded copy of the strip (``h + top + bottom`` rows) while the layer before
keeps the strip itself: twice the input. :class:`_StripConv` keeps the strip and the few borrowed rows and pads
again in backward (a copy), so each rank holds 1/S of one process's activations.

BatchNorm's statistics are those of the whole images (and of the whole dp batch when the Trainer syncs BatchNorm):
per-channel sums all-reduced over the group. :mod:`..data.sync_batchnorm` does that with differentiable tensor ops,
which keep ``x - mean`` too (1.3x a layer's activations); :class:`_GroupBatchNorm` keeps the input, as torch's fused
kernel does, and reduces the two sums of its backward (``sum dy``, ``sum dy * x_hat``) over the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.data.sync_batchnorm import update_running_stats
from lightning_parallel.parallel.spatial.halo import borrow_rows, return_rows

aten = torch.ops.aten


class _StripConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, halo, stride, width, dilation, groups):  # type: ignore[override]
        top, bottom = halo
        above, below = borrow_rows(x, top, bottom, group)
        padded = torch.cat([above, x, below], dim=2)  # (B, C, top + h + bottom, W)
        ctx.save_for_backward(x, above, below, weight)
        ctx.group, ctx.halo, ctx.args = group, halo, (stride, [0, width], dilation, groups)
        ctx.has_bias = bias is not None
        return aten.convolution(padded, weight, bias, stride, [0, width], dilation, False, [0, 0], groups)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, above, below, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.args
        padded = torch.cat([above, x, below], dim=2)  # again: not kept between forward and backward
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        bias_sizes = [weight.shape[0]] if ctx.has_bias else None
        dx, dw, db = aten.convolution_backward(
            grad, padded, weight, bias_sizes, stride, padding, dilation, False, [0, 0], groups, mask
        )
        if dx is not None:
            dx = return_rows(dx, *ctx.halo, ctx.group)
        return dx, dw, db, None, None, None, None, None, None


def strip_conv2d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    group: dist.ProcessGroup,
    halo: tuple[int, int],
    stride: tuple[int, int],
    width_padding: int,
    dilation: tuple[int, int],
    groups: int = 1,
) -> Tensor:
    """``F.conv2d`` of this rank's strip with ``halo = (top, bottom)`` rows borrowed from the neighbouring strips and
    no height padding: this rank's rows of the whole images' convolution."""
    return _StripConv.apply(x, weight, bias, group, halo, list(stride), width_padding, list(dilation), groups)


class _GroupBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, eps, stats):  # type: ignore[override]
        channels, dims = x.shape[1], [0, *range(2, x.dim())]
        compute = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(compute)
        count = torch.full((1,), x.numel() // channels, dtype=torch.float64, device=x.device)
        local = torch.cat([xc.sum(dims, dtype=torch.float64), xc.square().sum(dims, dtype=torch.float64), count])
        dist.all_reduce(local, group=group)
        n = local[2 * channels]
        mean = local[:channels] / n
        var = (local[channels : 2 * channels] / n - mean.square()).clamp_min(0)
        invstd = torch.rsqrt(var + eps).to(compute)
        shape = (1, channels) + (1,) * (x.dim() - 2)
        scale = invstd if weight is None else invstd * weight.to(compute)
        y = (xc - mean.to(compute).view(shape)) * scale.view(shape)
        if bias is not None:
            y += bias.to(compute).view(shape)
        stats.extend([mean, var, n])  # for the running statistics, outside autograd
        ctx.save_for_backward(x, mean.to(compute), invstd, weight)
        ctx.group, ctx.n, ctx.has_bias = group, float(n), bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, mean, invstd, weight = ctx.saved_tensors
        channels, dims = x.shape[1], [0, *range(2, x.dim())]
        shape = (1, channels) + (1,) * (x.dim() - 2)
        dy = grad.to(mean.dtype)
        xhat = (x.to(mean.dtype) - mean.view(shape)) * invstd.view(shape)
        local = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])  # this rank's parts: the parameters' gradients
        total = local.clone()
        dist.all_reduce(total, group=ctx.group)  # the whole batch's, for the input gradient through the statistics
        sum_dy, sum_dy_xhat = total[:channels].view(shape), total[channels:].view(shape)
        scale = invstd if weight is None else invstd * weight.to(mean.dtype)
        dx = (dy - (sum_dy + xhat * sum_dy_xhat) / ctx.n) * scale.view(shape)
        dw = local[channels:].to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = local[:channels].to(weight.dtype if weight is not None else x.dtype) if ctx.has_bias else None
        return dx.to(x.dtype), dw, db, None, None, None


def group_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
    eps: float,
    group: dist.ProcessGroup,
) -> Tensor:
    """Training-mode batch norm of this rank's ``x`` with the statistics of every rank's ``x`` in ``group``
    (``batch_norm_over_group``'s arguments and result, keeping only the input for backward)."""
    stats: list[Tensor] = []
    y = _GroupBatchNorm.apply(x, weight, bias, group, eps, stats)
    update_running_stats(running_mean, running_var, num_batches_tracked, momentum, *stats)
    return y
