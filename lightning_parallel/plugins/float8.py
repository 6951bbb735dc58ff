"""``precision=fp8`` for Trainer and Fabric users: torchao's float8 Linear layers over a ``bf16-mixed`` autocast.

Trainer::

    from lightning_parallel.plugins.float8 import Float8Precision
    trainer = L.Trainer(strategy="zero3", plugins=[Float8Precision(recipe="tensorwise", fsdp_float8_all_gather=True)])

Fabric::

    from lightning_parallel.plugins.float8 import Float8FabricPrecision
    fabric = L.Fabric(strategy="zero3", plugins=[Float8FabricPrecision()])

The plugin converts the model's Linear layers when the strategy takes the model (before pp, tp or ZeRO split it:
``convert_module``), and runs every step under the ``bf16-mixed`` autocast; the strategies see ``bf16-mixed`` (ZeRO-3
gathers bf16 for what stays in high precision, reduces gradients in fp32). The mechanism is
:mod:`lightning_parallel.parallel.float8`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.parallel.float8 import KEEP_HIGH_PRECISION, Float8Settings, convert
from lightning_parallel.plugins.precision import MeshMixedPrecision


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class _Float8Converts:
    """What both plugins share: the settings, the ``bf16-mixed`` autocast under them, and the conversion when the
    strategy takes the model (``convert_module``, before pp, tp or ZeRO split it)."""

    device: str

    def __init__(
        self,
        recipe: str = "tensorwise",
        fsdp_float8_all_gather: bool = False,
        keep: tuple[str, ...] = KEEP_HIGH_PRECISION,
        emulate: bool | None = None,
        device: str | None = None,
    ) -> None:
        self.settings = Float8Settings(recipe, fsdp_float8_all_gather, tuple(keep), emulate)
        super().__init__("bf16-mixed", device or _default_device())  # type: ignore[call-arg]  (the precision base)
        self.report: dict[str, str] = {}  # Linear path -> "float8" or why it stayed in high precision

    def convert_module(self, module: nn.Module) -> nn.Module:
        self.report.update(convert(module, self.settings, torch.device(self.device)))
        return module


class Float8Precision(_Float8Converts, MeshMixedPrecision):
    """FP8 training for ``Trainer``: the Linear layers in float8 (torchao), the rest under ``bf16-mixed``.

    Args:
        recipe: ``"tensorwise"`` or ``"rowwise"`` (:class:`~lightning_parallel.parallel.float8.Float8Settings`).
        fsdp_float8_all_gather: under ZeRO-3, gather the converted weights in float8 (tensorwise only).
        keep: module names left in high precision (default: heads, routers, gates).
        emulate: emulate the float8 GEMMs (None: on the CPU only; True also on a GPU below compute capability 8.9).
        device: the autocast device type (default: ``"cuda"`` when a GPU is there, else ``"cpu"``).
    """

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.clip_fn is None:  # Lightning's own strategies: its clipping
            return Precision.clip_grad_by_norm(self, optimizer, clip_val)
        return super().clip_grad_by_norm(optimizer, clip_val)


class Float8FabricPrecision(_Float8Converts, FabricMixedPrecision):
    """FP8 training for ``Fabric`` (the same settings as :class:`Float8Precision`): ``fabric.setup(model)`` converts
    the model's Linear layers before the strategy splits it."""


def float8_plugin(settings: Any, accelerator: str) -> Float8Precision:
    """The recipes' plugin for ``precision=fp8`` (``settings``: the precision group's keys)."""
    device = "cpu" if accelerator == "cpu" else None
    return Float8Precision(
        recipe=str(settings.recipe),
        fsdp_float8_all_gather=bool(settings.fsdp_float8_all_gather),
        emulate=settings.emulate,
        device=device,
    )
