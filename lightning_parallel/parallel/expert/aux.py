"""How the routers' auxiliary losses reach the gradients, whatever the layout. Pure torch.

A MoE layer does not return its load-balancing and z-losses: it attaches them to its output with
:class:`AttachAuxLoss`, whose backward gives the auxiliary term the gradient the main loss has at that moment
(Megatron-Core's ``MoEAuxLossAutoScaler``). The main loss reaches backward multiplied by the fp16 loss scale and
divided by the gradient-accumulation steps and, under pp, by the microbatches; whoever runs the backward says so
with :func:`aux_loss_scale`, so the gradient is that of ``main loss + coeff * aux`` on any layout, while the loss
the training step returns (and logs) stays the main loss alone. The MeshStrategy strategies and the pipeline
runner set it; under Lightning's own strategies :class:`~lightning_parallel.callbacks.moe.MoEAuxLossScale` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

_scale = [1.0]


def backward_scale() -> float:
    """The factor the main loss carries into the backward that is running (1 unless told otherwise)."""
    return _scale[-1]


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Backward passes run inside give the auxiliary losses the gradient ``scale`` (the main loss's factor)."""
    _scale.append(float(scale))
    try:
        yield
    finally:
        _scale.pop()


def set_aux_loss_scale(scale: float) -> None:
    """Set the factor until it is set again (Lightning callbacks, which cannot wrap the backward)."""
    _scale[0] = float(scale)


class AttachAuxLoss(torch.autograd.Function):
    """``output`` unchanged in forward; in backward, ``aux`` (a scalar) gets the gradient :func:`backward_scale`."""

    @staticmethod
    def forward(ctx, output: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.full(ctx.aux_shape, backward_scale(), dtype=ctx.aux_dtype, device=grad.device)
