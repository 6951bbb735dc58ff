"""The recipe GPT (``model=gpt_*``, ``model.kind=gpt``): its config from the settings, the checks of its own keys,
and the ``GPTModule`` each worker trains (built in ``configure_model``)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from lightning_parallel.models import GPTConfig, GPTModule
from lightning_parallel.recipes.config import GPTModelConf

MOE_KEYS = (
    "moe_experts",
    "moe_top_k",
    "moe_every",
    "moe_hidden",
    "moe_capacity_factor",
    "moe_shared_hidden",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
)


def gpt_config(m: DictConfig) -> GPTConfig:
    return GPTConfig(
        vocab_size=m.vocab_size,
        seq_len=m.seq_len,
        n_layer=m.n_layer,
        n_head=m.n_head,
        d_model=m.d_model,
        mlp_ratio=m.mlp_ratio,
        dropout=m.dropout,
        **{key: m[key] for key in MOE_KEYS},
    )


def check_gpt_model(cfg: DictConfig) -> None:
    """The model's own keys: positive sizes, MoE keys only with experts, a config GPTConfig takes."""
    m = cfg.model
    for key in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
        if m[key] < 1:
            raise ValueError(f"model.{key}={m[key]} must be a positive size: set model.{key} to 1 or more.")
    if not m.moe_experts:
        defaults = GPTModelConf()
        moe_set = [k for k in MOE_KEYS if k != "moe_experts" and m[k] != getattr(defaults, k)]
        if moe_set:
            raise ValueError(
                f"model.{moe_set[0]}={m[moe_set[0]]} only applies to MoE blocks, and model.moe_experts=0 makes every "
                "block dense: set model.moe_experts (or model=gpt_moe_tiny), or drop the override."
            )
    gpt_config(m)  # checks d_model against n_head, and the MoE settings


def check_gpt_layout(cfg: DictConfig, dims: Any) -> None:
    """``strategy.ep`` against ``model.moe_experts``, in the recipe's words (the strategy's check says it of
    the module's MoE layers)."""
    m, config = cfg.model, gpt_config(cfg.model)
    if dims.ep > 1 and not config.moe_blocks:
        raise ValueError(
            f"strategy.ep={dims.ep} splits the experts of MoE blocks, and model={m.get('name', 'gpt')} has none: use "
            "model=gpt_moe_tiny (or set model.moe_experts), or set strategy.ep=1."
        )
    if dims.ep > 1 and config.moe_experts % dims.ep:
        raise ValueError(
            f"strategy.ep={dims.ep} does not divide model.moe_experts={config.moe_experts}: choose ep among the "
            f"divisors of {config.moe_experts}."
        )


def build_gpt_module(cfg: DictConfig) -> GPTModule:
    """The LitGPT a worker trains; its GPT is built in ``configure_model`` (on meta when the layout splits it)."""
    m = cfg.model
    return GPTModule(
        gpt_config(m), lr=m.lr, weight_decay=m.weight_decay, warmup_steps=m.warmup_steps, build_in_configure_model=True
    )
