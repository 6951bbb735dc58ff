"""The GPT recipe's ``optimizer`` group (conf/optimizer/{adamw,sgd,muon}.yaml): its schema, its checks before
launch, and the optimizer it gives the model in place of the model's own ``configure_optimizers``.

- ``adamw`` (default): AdamW, weight decay on parameters of 2 or more dimensions only, the model's warmup (the
  recipes' values before the group existed: ``optimizer.lr`` and ``optimizer.weight_decay`` null take the model's).
- ``sgd``: SGD with ``optimizer.momentum`` and ``optimizer.nesterov``, the same decay split.
- ``muon``: :class:`~lightning_parallel.parallel.optim.muon.MuonAdamW`: Muon at ``optimizer.muon_lr`` on the
  Linear weight matrices, AdamW at ``optimizer.lr`` on the rest (embeddings, head, norms, biases; docs/muon.md),
  ``optimizer.ns_dtype`` bfloat16 (as torch) or float32.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.parallel.optim.muon import NS_DTYPES, MuonAdamW

OPTIMIZERS = ("adamw", "sgd", "muon")


@dataclass
class OptimizerConf:
    """``optimizer=adamw|sgd|muon``; null lr / weight_decay: the model's (``model.lr``, ``model.weight_decay``)."""

    name: str = "adamw"
    lr: float | None = None  # AdamW's or SGD's; under muon: AdamW's, for the parameters Muon does not step
    weight_decay: float | None = None
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    momentum: float = 0.95  # SGD's and Muon's
    nesterov: bool = True
    muon_lr: float = 0.02  # Muon's, for the weight matrices
    ns_dtype: str = "bfloat16"  # Muon's Newton-Schulz: bfloat16 (torch's) or float32 (exact)
    ns_steps: int = 5
    adjust_lr_fn: str | None = None  # None/"original" (Keller Jordan's), or "match_rms_adamw" (Moonshot's)


def check_optimizer(cfg: DictConfig) -> None:
    """Refuse before launch what the optimizer cannot do: an unknown name, a bad ``ns_dtype``, Muon under fp16's
    loss scaling, under async_ps, offload, or ZeRO-1/2 with tp (their slices are not pieces of whole matrices)."""
    opt = cfg.get("optimizer")
    if opt is None:
        return
    if opt.name not in OPTIMIZERS:
        raise ValueError(
            f"optimizer={opt.name!r} is not an optimizer of the recipes: pick one of {', '.join(OPTIMIZERS)}"
        )
    if opt.name != "muon":
        return
    if opt.ns_dtype not in NS_DTYPES:
        raise ValueError(f"optimizer.ns_dtype={opt.ns_dtype!r}: set it to one of {', '.join(NS_DTYPES)}")
    if str(cfg.precision.value) == "16-mixed":
        raise ValueError(
            "optimizer=muon with precision=16-mixed: fp16's loss scaling is not supported with Muon here; use "
            "precision=bf16-mixed (no loss scaling) or 32-true, or optimizer=adamw."
        )
    s = cfg.strategy
    flat = s.name in ("zero1", "zero2") or (s.name == "hybrid3d" and s.get("zero_stage") in (1, 2))
    if (
        s.name in ("zero2_offload", "async_ps")
        or (flat and (s.get("tp") or 1) > 1)
        or (flat and OmegaConf.select(s, "sharding.offload", default=False))
    ):
        raise ValueError(
            f"optimizer=muon with strategy={s.name} (zero_stage={s.get('zero_stage')}, tp={s.get('tp')}): Muon "
            "orthogonalizes each whole matrix, which async_ps, offload and ZeRO-1/2 with tp do not give it. Use "
            "strategy=zero3 or strategy.zero_stage=3 (each matrix orthogonalized whole on one owner rank), "
            "ZeRO-1/2 without tp or offload, or optimizer=adamw."
        )


def build_optimizer(opt: DictConfig, module: pl.LightningModule) -> torch.optim.Optimizer:
    """The optimizer ``opt`` names over ``module``'s trainable parameters."""
    lr = opt.lr if opt.lr is not None else module.lr
    decay = opt.weight_decay if opt.weight_decay is not None else module.weight_decay
    if opt.name == "muon":
        return MuonAdamW.from_module(
            module, lr=opt.muon_lr, weight_decay=decay, momentum=opt.momentum, nesterov=opt.nesterov,
            ns_steps=opt.ns_steps, adjust_lr_fn=opt.adjust_lr_fn, ns_dtype=opt.ns_dtype, adamw_lr=lr,
            adamw_betas=tuple(opt.betas), adamw_eps=opt.eps, adamw_weight_decay=decay,
        )  # fmt: skip
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": decay},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]] or groups[:1]
    if opt.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=opt.momentum, nesterov=opt.nesterov)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(opt.betas), eps=opt.eps)


def use_optimizer(module: pl.LightningModule, cfg: DictConfig) -> None:
    """Give ``module`` the run's optimizer: its ``configure_optimizers`` replaced on the instance, the model's
    warmup (``warmup_steps``) kept as a per-step LambdaLR."""
    opt = cfg.get("optimizer")
    if opt is None:
        return

    def configure_optimizers(self: pl.LightningModule) -> Any:
        optimizer = build_optimizer(opt, self)
        warmup = getattr(self, "warmup_steps", 0) or 0
        if warmup <= 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module.configure_optimizers = types.MethodType(configure_optimizers, module)  # type: ignore[method-assign]
