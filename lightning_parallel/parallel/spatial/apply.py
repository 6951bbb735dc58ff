"""A conv net's convolutions, BatchNorms and classifier input switched to strips of the images, and the batch split
by height. Pure torch.

The model is not rewritten: :func:`apply_spatial_parallel` patches, in place, every ``nn.Conv2d`` that runs on strips
(its forward borrows halo rows from the neighbouring strips, then convolves without height padding: :mod:`.ops`),
turns every BatchNorm there into a synced one (``convert_sync_batchnorm``) whose statistics are reduced over the
spatial group (and over dp as well when the Trainer already synced them over dp) by :mod:`.ops`' lean Function, and
gathers the strips in front of each module the LightningModule names in
``spatial_gather_modules()`` (the classifier). Pools with kernel = stride need nothing: strips stay aligned (checked
by :mod:`.layout`). The strategy splits every batch with :meth:`SpatialParallel.shard_batch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_parallel._compat import tree_map
from lightning_parallel.parallel.data.sync_batchnorm import (
    SyncBatchNorm1d,
    SyncBatchNorm2d,
    SyncBatchNorm3d,
    SyncBatchNormXd,
    convert_sync_batchnorm,
)
from lightning_parallel.parallel.spatial.layout import APPLIED, check_spatial_layout, conv_halo, strip_modules
from lightning_parallel.parallel.spatial.ops import group_batch_norm, strip_conv2d
from lightning_parallel.parallel.spatial.split import HEIGHT, check_height, gather_strips, shard_height

_SYNCED = (SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d, SyncBatchNormXd)


@dataclass
class SpatialParallel:
    """This rank's part of the spatial group: its strip of every image, and what was switched to strips.

    Args:
        group: the spatial ranks (the mesh's ``context`` role), in row order.
        multiple: every image height must be a multiple of it (spatial x the downsampling before the classifier).
    """

    group: dist.ProcessGroup
    multiple: int
    convs: list[str] = field(default_factory=list)  # convolutions that borrow halo rows
    norms: list[str] = field(default_factory=list)  # BatchNorms reduced over the spatial group
    gather: list[str] = field(default_factory=list)  # modules whose input is gathered from the strips

    @property
    def spatial(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def shard_batch(self, batch: Any) -> Any:
        """This rank's strip of every (B, C, H, W) tensor in ``batch`` (rows ``rank * H/S`` on); other values
        unchanged.

        Raises:
            ValueError: for images whose height is not a multiple of :attr:`multiple`.
        """
        return tree_map(lambda t: self._strip(t) if _is_image(t) else t, batch)

    def _strip(self, images: Tensor) -> Tensor:
        check_height(images.shape[HEIGHT], self.multiple, self.spatial)
        return shard_height(images, self.spatial, self.rank)


def _is_image(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 4


def _width_padding(conv: nn.Conv2d) -> tuple[int, int]:
    if not isinstance(conv.padding, str):
        return conv.padding[1], conv.padding[1]
    if conv.padding == "valid":
        return 0, 0
    reach = conv.dilation[1] * (conv.kernel_size[1] - 1)  # "same": the odd column on the right, as torch does
    return reach // 2, reach - reach // 2


def _strip_conv_forward(
    conv: nn.Conv2d, group: dist.ProcessGroup, halo: tuple[int, int], width: tuple[int, int], x: Tensor
) -> Tensor:
    left, right = width
    if left != right:  # "same" with an even kernel: the odd column on the right
        x, left = F.pad(x, (left, right)), 0
    return strip_conv2d(x, conv.weight, conv.bias, group, halo, conv.stride, left, conv.dilation, conv.groups)


def _strip_norm_forward(norm: _BatchNorm, group: dist.ProcessGroup, x: Tensor) -> Tensor:
    if not norm.training:  # running statistics: each strip normalizes on its own
        return _BatchNorm.forward(norm, x)
    tracked = norm.track_running_stats
    stats = (norm.running_mean, norm.running_var, norm.num_batches_tracked) if tracked else (None, None, None)
    return group_batch_norm(x, norm.weight, norm.bias, *stats, norm.momentum, norm.eps, group)


def _gather_input(group: dist.ProcessGroup, spatial: int, module: nn.Module, args: tuple) -> tuple:
    # backward scales this rank's rows by spatial: see split.py (the mean over dp x spatial is then exact)
    return (gather_strips(args[0], group, grad_scale=float(spatial)), *args[1:])


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)


def apply_spatial_parallel(
    root: nn.Module,
    group: dist.ProcessGroup,
    gather: Sequence[str],
    *,
    synced_group: dist.ProcessGroup | None = None,
    example: Any = None,
) -> SpatialParallel:
    """Switch ``root``'s strip modules (all but the ``gather`` modules and what they hold) to strips over ``group``.

    Args:
        root: the model, changed in place.
        group: the spatial ranks, in row order.
        gather: module paths (relative to ``root``) whose input is gathered from the strips: the classifier.
        synced_group: the ranks a BatchNorm already synced over dp (``Trainer(sync_batchnorm=True)``) reduces over
            instead: dp x spatial (the mesh's ``loss`` role). Unsynced BatchNorms reduce over ``group``.
        example: a (B, C, H, W) batch of whole images to check the layout on (traced on meta: nothing computed).

    Returns:
        the :class:`SpatialParallel` the strategy splits batches with.

    Raises:
        TypeError, ValueError: no convolution before the classifier, a gather path that names nothing, a pool or
            op that cannot run on strips, an example height that does not divide (see :mod:`.layout`).
    """
    spatial = dist.get_world_size(group)
    multiple = check_spatial_layout(root, spatial, gather, example)
    done = SpatialParallel(group, multiple, gather=list(gather))
    strips = strip_modules(root, gather)
    synced = any(isinstance(m, _SYNCED) for _, m in strips)
    norm_group = synced_group if synced and synced_group is not None else group
    for name, module in strips:
        if isinstance(module, nn.Conv2d):
            forward = partial(_strip_conv_forward, module, group, conv_halo(module), _width_padding(module))
            module.forward = forward  # type: ignore[method-assign]
            done.convs.append(name)
        elif isinstance(module, _BatchNorm):
            synced = convert_sync_batchnorm(module, norm_group)  # the type and group say what it reduces over
            synced.forward = partial(_strip_norm_forward, synced, norm_group)  # type: ignore[method-assign]
            _replace(root, name, synced)
            done.norms.append(name)
    for path in gather:
        root.get_submodule(path).register_forward_pre_hook(partial(_gather_input, group, spatial))
    object.__setattr__(root, APPLIED, done)  # not a submodule: a plain attribute the layout check finds
    return done
