"""Precision plugins for the mesh strategies: Lightning's own, with clipping by the norm of the whole model.

Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, which under
sharding are local slices; these plugins ask the strategy for the global norm instead.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

ClipFn = Callable[[Optimizer, int | float], Tensor]
SUPPORTED_PRECISION = ("32-true", "bf16-mixed")


class _GlobalNormClipping:
    clip_fn: ClipFn | None = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        assert self.clip_fn is not None, "the strategy sets clip_fn when it takes the plugin"
        self.clip_fn(optimizer, clip_val)


class MeshPrecision(_GlobalNormClipping, Precision):
    """``precision="32-true"``."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _GlobalNormClipping.clip_grad_by_norm(self, optimizer, clip_val)


class MeshMixedPrecision(_GlobalNormClipping, MixedPrecision):
    """``precision="bf16-mixed"``: bf16 autocast over fp32 parameters, gradients and optimizer states."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _GlobalNormClipping.clip_grad_by_norm(self, optimizer, clip_val)


def to_mesh_precision(plugin: Precision, strategy_name: str, clip_fn: ClipFn) -> Precision:
    """Lightning's plugin for ``precision=...`` turned into its mesh version, or a clear error."""
    if isinstance(plugin, _GlobalNormClipping):
        converted: Precision = plugin
    elif type(plugin) is Precision:
        converted = MeshPrecision()
    elif type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
        converted = MeshMixedPrecision("bf16-mixed", device=plugin.device)
    else:
        name = getattr(plugin, "precision", type(plugin).__name__)
        raise ValueError(
            f"precision={name!r} is not supported by strategy {strategy_name!r} yet: set precision to one of "
            f"{', '.join(SUPPORTED_PRECISION)}."
        )
    converted.clip_fn = clip_fn
    return converted
