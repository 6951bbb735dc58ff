"""Halo exchange: the rows a convolution needs from the neighbouring strips, and their gradients back. Pure torch.

Each rank of the spatial group holds a strip of every image (a band of rows, in rank order). A convolution whose
kernel reaches ``top`` rows above and ``bottom`` rows below its output rows needs the last ``top`` rows of the strip
above and the first ``bottom`` rows of the strip below: :class:`_HaloExchange` sends them by one batch of
``isend``/``irecv`` to the two neighbours and concatenates them around the strip (zeros at the image's edges: the
convolution's own zero padding). Its backward is the transpose: the gradients of the borrowed rows go home and are
added to the rows they were copied from. The first and last ranks have one neighbour, the others two.

Bytes one rank sends per convolution (:func:`halo_bytes`): forward ``(top [if not last] + bottom [if not first])
x B x C x W x element size``, the same again backward (none backward when the input needs no gradient: the images).

torch's DTensor convolution (``torch.distributed.tensor._tp_conv``) has a halo exchange but does not fit: it splits
only the width, exchanges over the world group rather than a mesh axis, and its backward drops the input gradient
(``_ring_send_recv_aggregate`` returns nothing in torch 2.13), so this module is used instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# bytes this rank sent, by direction ("forward", "backward"): the halo-bytes test reads it
SENT: dict[str, int] = {"forward": 0, "backward": 0}


def _swap(
    group: dist.ProcessGroup, up: Tensor | None, down: Tensor | None, from_up: Tensor | None, from_down: Tensor | None
) -> None:
    """Send ``up`` to the rank above and ``down`` to the rank below, receive into ``from_up`` and ``from_down`` (any
    of them None: nothing that way); one batch of point-to-point ops."""
    rank = dist.get_rank(group)
    ops = []
    for tensor, op, peer in (
        (from_up, dist.irecv, rank - 1),
        (from_down, dist.irecv, rank + 1),
        (up, dist.isend, rank - 1),
        (down, dist.isend, rank + 1),
    ):
        if tensor is not None:
            ops.append(dist.P2POp(op, tensor, dist.get_global_rank(group, peer), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _rows(x: Tensor, count: int) -> Tensor:
    """An empty (B, C, count, W) buffer like ``x``."""
    return x.new_empty((*x.shape[:2], count, x.shape[3]))


def _nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def borrow_rows(x: Tensor, top: int, bottom: int, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """The ``top`` rows above and ``bottom`` rows below this rank's strip ``x`` (B, C, h, W), from the neighbouring
    ranks (zeros at the image's edges)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    first, last = rank == 0, rank == size - 1
    # my first rows are the bottom halo of the rank above, my last rows the top halo of the rank below
    up = x[:, :, :bottom].contiguous() if bottom and not first else None
    down = x[:, :, x.shape[2] - top :].contiguous() if top and not last else None
    from_up = _rows(x, top) if top and not first else None
    from_down = _rows(x, bottom) if bottom and not last else None
    _swap(group, up, down, from_up, from_down)
    SENT["forward"] += _nbytes(up, down)
    above = from_up if from_up is not None else x.new_zeros((*x.shape[:2], top, x.shape[3]))
    below = from_down if from_down is not None else x.new_zeros((*x.shape[:2], bottom, x.shape[3]))
    return above, below


def return_rows(grad: Tensor, top: int, bottom: int, group: dist.ProcessGroup) -> Tensor:
    """The transpose of :func:`borrow_rows`: the gradient of a padded strip (B, C, top + h + bottom, W) back to
    (B, C, h, W), the borrowed rows' gradients sent home and added to the rows they were copied from."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    first, last = rank == 0, rank == size - 1
    h = grad.shape[2] - top - bottom
    own = grad[:, :, top : top + h].contiguous()  # a copy: the neighbours' parts are added to it below
    up = grad[:, :, :top].contiguous() if top and not first else None  # borrowed from the rank above
    down = grad[:, :, top + h :].contiguous() if bottom and not last else None  # borrowed from the one below
    from_down = _rows(own, top) if top and not last else None  # the rank below borrowed my last rows
    from_up = _rows(own, bottom) if bottom and not first else None  # the rank above borrowed my first rows
    _swap(group, up, down, from_up, from_down)
    SENT["backward"] += _nbytes(up, down)
    if from_down is not None:
        own[:, :, h - top :] += from_down
    if from_up is not None:
        own[:, :, :bottom] += from_up
    return own


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, top: int, bottom: int, group: dist.ProcessGroup) -> Tensor:
        above, below = borrow_rows(x, top, bottom, group)
        ctx.top, ctx.bottom, ctx.group = top, bottom, group
        return torch.cat([above, x, below], dim=2)  # (B, C, top + h + bottom, W)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return return_rows(grad, ctx.top, ctx.bottom, ctx.group), None, None, None


def halo_exchange(x: Tensor, top: int, bottom: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's strip with ``top`` rows of the strip above and ``bottom`` rows of the strip below around it.

    Args:
        x: (B, C, h, W), this rank's rows of the images (rank order is row order); h >= top and h >= bottom.
        top, bottom: rows to borrow above and below (0 or more); zeros where the image ends.
        group: the spatial ranks.

    Returns:
        (B, C, top + h + bottom, W); its backward returns the borrowed rows' gradients to their owners.
    """
    if top == 0 and bottom == 0:
        return x
    return _HaloExchange.apply(x, top, bottom, group)


def halo_bytes(
    batch: int,
    channels: int,
    width: int,
    top: int,
    bottom: int,
    rank: int,
    size: int,
    elem: int,
    backward: bool = False,
) -> int:
    """Bytes ``rank`` of ``size`` sends for one convolution's halo, forward: ``top`` rows to the rank below (unless it
    is the last) and ``bottom`` rows to the rank above (unless it is the first); backward the borrowed rows' gradients
    go home: ``top`` rows up (unless first), ``bottom`` rows down (unless last)."""
    first, last = rank == 0, rank == size - 1
    if backward:
        rows = (0 if first else top) + (0 if last else bottom)
    else:
        rows = (0 if last else top) + (0 if first else bottom)
    return rows * batch * channels * width * elem
