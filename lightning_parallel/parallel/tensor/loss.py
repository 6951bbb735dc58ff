"""The vocabulary-parallel loss: logits left split over tp by the head, the cross-entropy computed on the shards
(torch's ``loss_parallel``), the value returned as a plain tensor. Pure torch.

The module's own ``loss(output, target)`` is wrapped, not rewritten: inside ``loss_parallel`` torch's
cross-entropy takes DTensor logits sharded on the class dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

LossFn = Callable[..., Tensor]


def full_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` returning a plain tensor when it comes out of a vocabulary-parallel computation (for callers
    that already run inside ``loss_parallel``: the pipeline's schedules, whose backward needs it too)."""

    def loss(*args: Any, **kwargs: Any) -> Tensor:
        value = loss_fn(*args, **kwargs)
        return value.full_tensor() if isinstance(value, DTensor) else value

    return loss


def vocab_parallel_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` run inside ``loss_parallel``, so it accepts logits left sharded over the vocabulary."""

    def loss(*args: Any, **kwargs: Any) -> Tensor:
        with loss_parallel():
            value = loss_fn(*args, **kwargs)
        return value.full_tensor() if isinstance(value, DTensor) else value

    return loss
