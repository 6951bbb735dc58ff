"""LoRA on LitGPT's ``GPT`` with LitGPT's own pieces (``litgpt.lora``): its ``Config`` with the ``lora_*`` fields, its
``GPT`` with ``LoRALinear`` / ``LoRAQKVLinear`` layers, its base-checkpoint loading and
``mark_only_lora_as_trainable``; the checks before any process starts.

The settings are LitGPT's, by LitGPT's names (``litgpt finetune_lora``'s flags, the fields of
``litgpt.lora.Config``): ``{"lora_r": 8, "lora_alpha": 16, "lora_query": True, "lora_value": True}``. The model is
built as ``litgpt/finetune/lora.py`` builds it: ``litgpt.lora.GPT(config)``, the base weights loaded with
``strict=False`` (the LoRA modules map the base names, ``attn.qkv.weight`` to ``attn.qkv.linear.weight``), here
checked to leave nothing but the adapters missing, then ``mark_only_lora_as_trainable``. The adapters are drawn
from a fixed seed with the global generator left as it was, so every process builds the same ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

import torch
from torch import nn

from lightning_parallel.causal_lm import refuse_adapter_layouts
from lightning_parallel.parallel.mesh import ParallelDims

# the settings a LoRA layer reads, and the flags that choose the adapted layers (litgpt.lora.Config's fields)
TARGETS = ("lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp", "lora_head")
# layouts LoRA on a LitGPT model cannot take yet, by the degree's setting name
NOT_YET = ("cp", "ep")


def lora_fields() -> list[str]:
    from litgpt.lora import Config

    return [f.name for f in fields(Config) if f.name.startswith("lora_")]


def lora_config(config: Any, lora: Mapping[str, Any] | None) -> Any:
    """``config`` as a ``litgpt.lora.Config`` with the ``lora`` settings, or None when there is no LoRA (no settings
    and ``config`` is not a ``litgpt.lora.Config`` with ``lora_r > 0``).

    Raises:
        ValueError: a setting ``litgpt.lora.Config`` does not have, a rank below 1, or no layer chosen.
    """
    from litgpt.lora import Config

    if lora is None:
        if not isinstance(config, Config) or config.lora_r <= 0:
            return None
        lora = {}
    unknown = sorted(set(lora) - set(lora_fields()))
    if unknown:
        raise ValueError(
            f"LitGPTCausalLM(lora=...): {unknown} are not LitGPT LoRA settings; it takes litgpt.lora.Config's "
            f"{lora_fields()} (the flags of `litgpt finetune_lora`)."
        )
    config = Config(**{**asdict(config), **lora})
    if config.lora_r < 1:
        raise ValueError(f"LitGPTCausalLM(lora=...): lora_r={config.lora_r}; set the adapters' rank lora_r >= 1.")
    if not any(getattr(config, flag) for flag in TARGETS):
        raise ValueError(
            f"LitGPTCausalLM(lora=...) adapts no layer: set at least one of {list(TARGETS)} to True (LitGPT's "
            "finetune_lora default is lora_query and lora_value)."
        )
    return config


def build_lora_gpt(config: Any, weights: Mapping[str, torch.Tensor] | None, seed: int = 0) -> nn.Module:
    """``litgpt.lora.GPT(config)`` with every parameter drawn from ``seed`` (the global generator is left as it was),
    ``weights`` (a base ``GPT``'s state dict, or None to keep the drawn base) loaded as LitGPT's finetune/lora.py
    does, and only the adapters trainable (``mark_only_lora_as_trainable``).

    Raises:
        ValueError: ``weights`` lack a base weight, or hold one the LoRA model does not have.
    """
    from litgpt.lora import GPT, mark_only_lora_as_trainable

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    if weights is not None:
        result = model.load_state_dict(weights, strict=False)
        missing = [key for key in result.missing_keys if "lora_" not in key]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"LitGPTCausalLM(lora=...): the base weights do not fit the model's config (missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}): pass the checkpoint folder the config came with."
            )
    mark_only_lora_as_trainable(model)
    return model


def check_lora_degrees(config: Any, dims: ParallelDims) -> None:
    """Refuse the layouts LoRA on a LitGPT model cannot take yet (cp, ep), and under tp LoRA dropout (each tp
    rank would draw its own mask for the split input), before any process group exists.

    Raises:
        ValueError: naming the setting and what works.
    """
    works = "LitGPT LoRA runs under ZeRO 0-3, tp (with or without sequence_parallel) and pp"
    refuse_adapter_layouts(NOT_YET, "LitGPTCausalLM(lora=...)", works, dims)
    if dims.tp > 1 and config.lora_dropout:
        raise ValueError(
            f"lora_dropout={config.lora_dropout} with tp={dims.tp} is not supported yet: set lora_dropout=0.0, "
            "or tp=1 (ZeRO 0-3 take it)."
        )
