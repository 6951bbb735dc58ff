"""BatchNorm whose training statistics are those of the whole data-parallel batch, on any device. Pure torch.

Hand-written because torch's ``nn.SyncBatchNorm`` trains only on CUDA, HPU and XPU devices (on CPU it raises
"expected input tensor to be on GPU") and syncs over one flat group that knows nothing of tensor parallelism.

In training mode each rank reduces its per-channel sum, sum of squares and element count in one all-reduce over
the group; mean and (biased) variance of the global batch normalize the local batch, and the running statistics
move with the unbiased variance of the global count. The all-reduce is differentiable, so the gradient reaching
each rank's input includes what the other ranks' losses owe to the shared statistics: one forward and one
backward all-reduce of ``2 * C + 1`` numbers per layer. A batch split over the group is then normalized, and
trains, as BatchNorm does the whole batch in one process. Eval mode, and a group of one, run the plain BatchNorm
forward.

Under channel-split tensor parallelism (:class:`~lightning_parallel.parallel.tensor.conv.ChannelNormParallel`) the
input arrives as a DTensor ``Shard(1)`` and the parameters and running statistics as ``Shard(0)``: each rank
computes on its own channels, and the group is the dp axis, whose ranks hold the same channels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

__all__ = [
    "SyncBatchNorm1d",
    "SyncBatchNorm2d",
    "SyncBatchNorm3d",
    "SyncBatchNormXd",
    "batch_norm_over_group",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
]


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _local(t: Tensor | None) -> Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def batch_norm_over_group(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
    eps: float,
    group: dist.ProcessGroup | None,
) -> Tensor:
    """Training-mode batch norm of local tensors with the statistics of the batch summed over ``group``.

    Args:
        x: this rank's input ``(N, C, *)``.
        weight: affine scale ``(C,)`` or None.
        bias: affine shift ``(C,)`` or None.
        running_mean: updated in place with the global mean; None to leave running statistics alone.
        running_var: updated in place with the global unbiased variance.
        num_batches_tracked: incremented in place (with ``momentum=None``: the cumulative average's count).
        momentum: BatchNorm's momentum; None for a cumulative average.
        eps: added to the variance.
        group: the ranks whose batches together make the batch; None for the whole world.

    Returns:
        The normalized ``x``, in its dtype.
    """
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    compute = torch.promote_types(x.dtype, torch.float32)  # half inputs normalize in float32, as torch's kernels do
    xc = x.to(compute)
    # float64 sums: the count stays exact and E[x^2] - E[x]^2 keeps the accuracy float32 inputs have
    count = torch.full((1,), x.numel() // max(channels, 1), dtype=torch.float64, device=x.device)
    local = torch.cat([xc.sum(dims, dtype=torch.float64), xc.square().sum(dims, dtype=torch.float64), count])
    # funcol's all_reduce has a registered backward that all-reduces the gradient (a sum): each rank's input
    # then gets the gradient of every rank's loss through the shared statistics. torch.distributed.nn's
    # all_reduce does the same but is deprecated in torch 2.13 and warns on every call.
    total = funcol.all_reduce(local, "sum", group if group is not None else dist.group.WORLD)
    count = total[2 * channels]
    mean = total[:channels] / count
    var = (total[channels : 2 * channels] / count - mean.square()).clamp_min(0)  # biased: what normalizes
    invstd = torch.rsqrt(var + eps)

    shape = (1, channels) + (1,) * (x.dim() - 2)
    scale = invstd if weight is None else invstd * weight
    y = (xc - mean.to(compute).view(shape)) * scale.to(compute).view(shape)
    if bias is not None:
        y = y + bias.to(compute).view(shape)

    update_running_stats(running_mean, running_var, num_batches_tracked, momentum, mean, var, count)
    return y.to(x.dtype)


def update_running_stats(
    running_mean: Tensor | None,
    running_var: Tensor | None,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
    mean: Tensor,
    var: Tensor,
    count: Tensor,
) -> None:
    """BatchNorm's running statistics from a batch's ``mean`` and biased ``var`` over ``count`` values per channel
    (torch's update: momentum, or the cumulative average when momentum is None)."""
    if running_mean is None or running_var is None:
        return
    with torch.no_grad():
        factor = 0.0 if momentum is None else momentum
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
            if momentum is None:
                factor = 1.0 / float(num_batches_tracked)
        # one value per channel in the whole batch has no unbiased variance; torch raises, we keep 0
        unbiased = var * count / (count - 1).clamp_min(1)
        running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
        running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)


def _check_layout(module: nn.Module, x: DTensor) -> None:
    """The input may be replicated or split on channels; the parameters must be split the same way."""
    for i, placement in enumerate(x.placements):
        if not (placement.is_replicate() or placement.is_shard(1)):
            raise ValueError(
                f"{type(module).__name__} got an input DTensor placed {x.placements}: batch statistics need every "
                "sample of each channel, so it must be Replicate() or Shard(1) (channels, as ChannelNormParallel "
                "leaves it) on each mesh axis. Split the batch over the dp process group instead."
            )
        for name in ("weight", "bias", "running_mean", "running_var"):
            t = getattr(module, name, None)
            if isinstance(t, DTensor) and t.placements[i].is_shard(0) != placement.is_shard(1):
                raise ValueError(
                    f"{type(module).__name__}.{name} is placed {t.placements} but its input {x.placements}: shard "
                    "the parameters and running statistics on dim 0 exactly where the input is sharded on "
                    "channels (ChannelNormParallel does both)."
                )


class _SyncBatchNorm(_BatchNorm):
    """What every variant shares: the process group, and the forward that syncs only where it must."""

    process_group: dist.ProcessGroup | None

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def forward(self, input: Tensor) -> Tensor:
        if not self.training or _group_size(self.process_group) <= 1:
            # the plain BatchNorm forward; named, not super(): nn.SyncBatchNorm's own forward would try to sync
            return _BatchNorm.forward(self, input)
        self._check_input_dim(input)
        tracked = self.track_running_stats
        args = (self.weight, self.bias) + (
            (self.running_mean, self.running_var, self.num_batches_tracked) if tracked else (None, None, None)
        )
        if not isinstance(input, DTensor):
            return batch_norm_over_group(input, *args, self.momentum, self.eps, self.process_group)
        _check_layout(self, input)
        # each rank normalizes its own channels; the local gradients are the shards of the DTensors' gradients
        y = batch_norm_over_group(
            input.to_local(), *(_local(t) for t in args), self.momentum, self.eps, self.process_group
        )
        return DTensor.from_local(y, input.device_mesh, input.placements, run_check=False)


class SyncBatchNorm1d(_SyncBatchNorm, nn.BatchNorm1d):
    """:class:`torch.nn.BatchNorm1d` with training statistics over ``process_group`` (None: the whole world)."""


class SyncBatchNorm2d(_SyncBatchNorm, nn.BatchNorm2d):
    """:class:`torch.nn.BatchNorm2d` with training statistics over ``process_group`` (None: the whole world)."""


class SyncBatchNorm3d(_SyncBatchNorm, nn.BatchNorm3d):
    """:class:`torch.nn.BatchNorm3d` with training statistics over ``process_group`` (None: the whole world)."""


class SyncBatchNormXd(_SyncBatchNorm, nn.SyncBatchNorm):
    """Any other BatchNorm (torch's ``nn.SyncBatchNorm`` among them), for inputs of 2 or more dims, on any
    device: an ``nn.SyncBatchNorm`` subclass, so code that checks for one still accepts it."""


_VARIANTS: tuple[tuple[type[nn.Module], type[_SyncBatchNorm]], ...] = (
    (nn.BatchNorm1d, SyncBatchNorm1d),
    (nn.BatchNorm2d, SyncBatchNorm2d),
    (nn.BatchNorm3d, SyncBatchNorm3d),
)
_PLAIN = {SyncBatchNorm1d: nn.BatchNorm1d, SyncBatchNorm2d: nn.BatchNorm2d, SyncBatchNorm3d: nn.BatchNorm3d}


def _rebuilt(module: _BatchNorm, cls: type[_BatchNorm], **kwargs: object) -> _BatchNorm:
    """A ``cls`` holding ``module``'s very parameters and buffers (same device, dtype, requires_grad)."""
    with torch.device("meta"):  # placeholders, replaced below: nothing is allocated or initialized twice
        new = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, **kwargs)
    for name, param in module.named_parameters(recurse=False):
        new.register_parameter(name, param)
    for name, buffer in module.named_buffers(recurse=False):
        new.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
    new.train(module.training)
    if hasattr(module, "qconfig"):
        new.qconfig = module.qconfig
    return new


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every BatchNorm in ``module`` by its synced variant over ``process_group``, keeping its parameters
    and running statistics (the same tensor objects, so optimizers and meta-device layers are unaffected).

    ``BatchNorm1d/2d/3d`` (and their subclasses) become :class:`SyncBatchNorm1d/2d/3d`; any other BatchNorm,
    torch's ``nn.SyncBatchNorm`` included, becomes :class:`SyncBatchNormXd`. Layers already synced here only
    change group. Apply it before tensor parallelism or sharding, which wrap the parameters.

    Args:
        module: the model, changed in place below its root.
        process_group: the ranks whose batches together make the batch (the data-parallel group); None for the
            whole world.

    Returns:
        ``module``, or its replacement when ``module`` itself is a BatchNorm.

    Raises:
        ValueError: for a lazy BatchNorm whose size is not known yet.
    """
    if isinstance(module, _SyncBatchNorm):
        module.process_group = process_group
        return module
    if isinstance(module, _BatchNorm):
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(
                f"{type(module).__name__} does not know its num_features before its first forward: run one "
                "batch through the model before converting it, or use a BatchNorm with num_features."
            )
        cls = next((sync for plain, sync in _VARIANTS if isinstance(module, plain)), SyncBatchNormXd)
        return _rebuilt(module, cls, process_group=process_group)
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            module.add_module(name, converted)
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm`: each synced layer becomes torch's ``BatchNorm1d/2d/3d`` (``Xd``:
    ``nn.SyncBatchNorm``) holding the same parameters and running statistics.

    Args:
        module: the model, changed in place below its root.

    Returns:
        ``module``, or its replacement when ``module`` itself is a synced BatchNorm.
    """
    if isinstance(module, _SyncBatchNorm):
        return _rebuilt(module, _PLAIN.get(type(module), nn.SyncBatchNorm))
    for name, child in module.named_children():
        reverted = revert_sync_batchnorm(child)
        if reverted is not child:
            module.add_module(name, reverted)
    return module
