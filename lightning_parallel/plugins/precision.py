"""Precision plugins for the mesh strategies: Lightning's own, with clipping by the norm of the whole model
and, for fp16, a loss scaler whose overflow verdict every rank of the mesh shares.

Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, which under
sharding are local slices; these plugins ask the strategy for the global norm instead. For ``16-mixed``
torch's ``GradScaler`` is replaced by :class:`~lightning_parallel.parallel.loss_scaler.LossScaler`
(it handles DTensor and plain gradients together and agrees on overflow over pp, dp and tp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.parallel.loss_scaler import LossScaler

ClipFn = Callable[[Optimizer, int | float], Tensor]
SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_LIGHTNING_AMP_KEY = "MixedPrecision"  # where single-process Lightning keeps the fp16 scaler state


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
    """``precision="bf16-mixed"`` or ``"16-mixed"``: autocast over fp32 parameters, gradients and optimizer states.

    ``16-mixed`` scales the loss with a :class:`LossScaler` (dynamic, GradScaler's defaults): gradients are
    unscaled after the strategy's reduction and before clipping, and a step whose gradients hold inf or NaN
    on any rank is skipped on every rank. The scale is saved in checkpoints where single-process Lightning
    keeps it, so fp16 checkpoints move between our strategies and a plain Trainer.

    Args:
        precision: ``"bf16-mixed"`` or ``"16-mixed"``.
        device: the autocast device type (``"cpu"``, ``"cuda"``).
        scaler: the fp16 loss scaler (default: a fresh :class:`LossScaler`); must be None for bf16.
    """

    def __init__(
        self, precision: Literal["16-mixed", "bf16-mixed"], device: str, scaler: LossScaler | None = None
    ) -> None:
        if precision == "16-mixed" and scaler is None:
            scaler = LossScaler(device=device)
        super().__init__(precision, device, scaler)  # type: ignore[arg-type]  (GradScaler's interface)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _GlobalNormClipping.clip_grad_by_norm(self, optimizer, clip_val)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.pop(type(self).__qualname__, None)
        if state:
            checkpoint[_LIGHTNING_AMP_KEY] = state

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.scaler is not None and _LIGHTNING_AMP_KEY in checkpoint:
            self.scaler.load_state_dict(checkpoint[_LIGHTNING_AMP_KEY])


class MeshHalfPrecision(_GlobalNormClipping, HalfPrecision):
    """``precision="bf16-true"``: parameters, gradients, optimizer states and compute in bf16.

    Lightning converts the module before the strategy splits it, so ZeRO's flat buffers, FSDP2's shards
    (no mixed-precision policy needed: the parameters already are bf16) and pipeline stages all hold bf16.
    """

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _GlobalNormClipping.clip_grad_by_norm(self, optimizer, clip_val)


def loss_scaler_like(scaler: Any, device: str) -> LossScaler:
    """Our scaler with the settings of a torch ``GradScaler`` (its defaults when it is disabled)."""
    if scaler is None or not scaler.is_enabled():
        return LossScaler(device=device)
    return LossScaler(
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        device=device,
    )


def cpu_fp16_plugin(precision: str | None, accelerator: Any) -> MeshMixedPrecision | None:
    """The plugin that runs ``precision="16-mixed"`` as fp16 on CPU under a mesh strategy, else None.

    Lightning turns ``16-mixed`` on CPU into bf16 ("AMP with fp16 is not supported on CPU"), but torch's CPU
    autocast runs fp16 (linear, matmul, attention and convolution in fp16, losses in fp32). Asking for fp16 there
    is explicit, through Lightning's own inputs: ``Trainer(plugins=[plugin])`` with ``precision`` unset, or
    ``MeshStrategy(precision_plugin=plugin)`` (``MixedPrecision("16-mixed", "cpu")`` works as well: the strategy
    turns it into this, with its scaler's settings). Nothing of Lightning's is patched.

    Args:
        precision: the Trainer's precision flag.
        accelerator: the Trainer's accelerator flag (``"auto"``: the host when no GPU is there).
    """
    on_cpu = accelerator == "cpu" or type(accelerator).__name__ == "CPUAccelerator"
    if accelerator == "auto":
        on_cpu = not torch.cuda.is_available() and not torch.backends.mps.is_available()
    return MeshMixedPrecision("16-mixed", "cpu") if precision == "16-mixed" and on_cpu else None


def to_mesh_precision(plugin: Precision, strategy_name: str, clip_fn: ClipFn) -> Precision:
    """Lightning's plugin for ``precision=...`` turned into its mesh version, or a clear error."""
    if isinstance(plugin, _GlobalNormClipping):
        converted: Precision = plugin
    elif type(plugin) is Precision:
        converted = MeshPrecision()
    elif type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
        converted = MeshMixedPrecision("bf16-mixed", device=plugin.device)
    elif type(plugin) is MixedPrecision and plugin.precision == "16-mixed":
        converted = MeshMixedPrecision("16-mixed", plugin.device, loss_scaler_like(plugin.scaler, plugin.device))
    elif type(plugin) is HalfPrecision and plugin.precision == "bf16-true":
        converted = MeshHalfPrecision("bf16-true")
    else:
        name = getattr(plugin, "precision", type(plugin).__name__)
        hint = " (fp16 weights without fp32 master copies lose small updates)" if name == "16-true" else ""
        raise ValueError(
            f"precision={name!r} is not supported by strategy {strategy_name!r}{hint}: set precision to one of "
            f"{', '.join(SUPPORTED_PRECISION)}."
        )
    converted.clip_fn = clip_fn
    return converted


def param_dtype_of(plugin: Any) -> torch.dtype | None:
    """The dtype ZeRO-3 gathers parameters in and computes with under a Trainer's or Fabric's precision plugin: bf16
    under ``bf16-mixed`` (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``, gradients reduced in fp32: torchtitan's
    default); None (the parameters' own) otherwise: fp32 under ``32-true`` and ``16-mixed``, bf16 under ``bf16-true``.
    The sharded fp32 parameters and the optimizer's states are the same in every case."""
    return param_dtype_for(getattr(plugin, "precision", None))


def param_dtype_for(precision: str | None) -> torch.dtype | None:
    """:func:`param_dtype_of` by the precision's name (``"bf16-mixed"`` -> bf16, anything else None)."""
    return torch.bfloat16 if precision == "bf16-mixed" else None


def loss_scale_of(plugin: Precision) -> float:
    """The factor the loss is multiplied by before backward: fp16's current scale, else 1."""
    scaler = getattr(plugin, "scaler", None)
    return scaler.get_scale() if isinstance(scaler, LossScaler) else 1.0
