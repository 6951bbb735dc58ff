"""The recipe VGG (``model=vgg*``, ``model.kind=vgg``): its config from the settings, the checks of its own keys,
and the LitVGG each worker trains (built in ``configure_model``)."""

from __future__ import annotations

from omegaconf import DictConfig

from lightning_parallel.models import LitVGG, VGGConfig
from lightning_parallel.models.lit_vgg import LR_SCHEDULES, OPTIMIZERS


def vgg_config(m: DictConfig) -> VGGConfig:
    return VGGConfig(
        name=m.name, width=m.width, num_classes=m.num_classes, image_size=m.image_size, batch_norm=m.batch_norm
    )


def scaled_lr(cfg: DictConfig) -> float:
    """``model.lr`` scaled linearly with the global batch (Goyal et al., 2017), unless lr_reference_batch is None."""
    reference = cfg.model.lr_reference_batch
    return cfg.model.lr if reference is None else cfg.model.lr * cfg.data.global_batch_size / reference


def check_vgg_model(cfg: DictConfig) -> None:
    """The model's own keys: positive sizes, a known name and image size, optimizer and schedule."""
    m = cfg.model
    for key in ("width", "num_classes"):
        if m[key] < 1:
            raise ValueError(f"model.{key}={m[key]} must be a positive size: set model.{key} to 1 or more.")
    vgg_config(m)  # checks the name and image size
    if m.optimizer not in OPTIMIZERS:
        raise ValueError(f"model.optimizer={m.optimizer!r} is unknown: use one of {OPTIMIZERS}.")
    if m.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"model.lr_schedule={m.lr_schedule!r} is unknown: use one of {LR_SCHEDULES}.")
    if m.lr_reference_batch is not None and m.lr_reference_batch <= 0:
        raise ValueError(f"model.lr_reference_batch={m.lr_reference_batch} must be positive, or null for no scaling.")


def build_vgg_module(cfg: DictConfig) -> LitVGG:
    """The LitVGG a worker trains; its VGG is built in ``configure_model`` (on meta when the layout splits it)."""
    m = cfg.model
    return LitVGG(
        vgg_config(m),
        optimizer=m.optimizer,
        lr=scaled_lr(cfg),
        momentum=m.momentum,
        weight_decay=m.weight_decay,
        warmup_steps=m.warmup_steps,
        lr_schedule=m.lr_schedule,
        build_in_configure_model=True,
    )
