"""The planner's view of the recipe models (:func:`gpt_spec`, :func:`vgg_spec`: a model config of ``conf/model/``
built on the meta device) and device-memory sizes as the CLIs and ``strategy.auto_device_memory`` write them
(:func:`parse_bytes`). Used by ``python -m lightning_parallel.plan`` and by ``strategy=auto`` (recipes/auto.py)."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from lightning_parallel.models.gpt import GPTConfig, RecipeGPT, gpt_tp_plan
from lightning_parallel.models.vgg import VGG, VGGConfig, vgg_tp_plan
from lightning_parallel.planning.estimate import OPTIMIZER_STATES
from lightning_parallel.planning.profile import ModelSpec
from lightning_parallel.recipes.gpt_model import MOE_KEYS

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_UNITS["TIB"] = 2**40


def parse_bytes(text: str) -> float:
    """``80GB`` (10^9), ``80GiB`` (2^30), ``512MB`` or a plain byte count."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"--device-memory={text!r} is not a size: write it like 80GB, 80GiB or 512MB.")
    return float(match.group(1)) * _UNITS[unit]


# LoRA's targets in the recipe GPT (--lora-rank): the attention and MLP linears (a shared expert's too), not the
# router nor the routed experts (grouped weights, no linear layers), nor the embedding and head
GPT_LORA_TARGETS = r"^blocks\.\d+\.(attn\.(q|k|v|proj)|mlp\.(fc|proj|shared\.\d+))$"


def gpt_spec(m: DictConfig, lora_rank: int = 0) -> ModelSpec:
    """The planner's view of a recipe GPT; ``lora_rank`` > 0: LoRA adapters on :data:`GPT_LORA_TARGETS`, the
    base frozen."""
    moe = {key: m[key] for key in MOE_KEYS}
    config = GPTConfig(m.vocab_size, m.seq_len, m.n_layer, m.n_head, m.d_model, m.mlp_ratio, m.dropout, **moe)
    with torch.device("meta"):
        model = RecipeGPT(config)

    def loss(logits: torch.Tensor, batch: int) -> torch.Tensor:  # LitGPT.loss
        targets = torch.zeros(logits.shape[:-1], dtype=torch.long)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    return ModelSpec(
        model=model,
        layers=model.layers(),
        plan=gpt_tp_plan("", False, config.moe_blocks, config.n_layer),
        make_input=lambda b: torch.zeros(b, config.seq_len, dtype=torch.long),
        loss=loss,
        check_tp=lambda tp: RecipeGPT.check_tensor_parallel_config(config, tp),
        optimizer_states=OPTIMIZER_STATES["adamw"],
        num_experts=config.moe_experts,
        lora_rank=lora_rank,
        lora_targets=GPT_LORA_TARGETS,
    )


def vgg_spec(m: DictConfig) -> ModelSpec:
    config = VGGConfig(m.name, m.num_classes, m.width, image_size=m.image_size, batch_norm=m.batch_norm)
    with torch.device("meta"):
        model = VGG(config)

    def loss(logits: torch.Tensor, batch: int) -> torch.Tensor:  # LitVGG.loss
        return F.cross_entropy(logits.float(), torch.zeros(batch, dtype=torch.long))

    optimizer = m.optimizer if m.optimizer == "adamw" or m.momentum else "sgd_no_momentum"
    return ModelSpec(
        model=model,
        layers=model.layers(),
        plan=vgg_tp_plan("", config),
        make_input=lambda b: torch.randn(b, config.in_channels, config.image_size, config.image_size),
        loss=loss,
        check_tp=lambda tp: VGG.check_tensor_parallel_config(config, tp),
        optimizer_states=OPTIMIZER_STATES[optimizer],
    )
