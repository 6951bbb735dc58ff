"""The ``peft`` config group of the GPT recipe: ``peft=none`` (every weight trains) or ``peft=lora`` (the ``peft``
library's LoRA adapters on a frozen base, ``model=hf*``), the checks that run before any worker starts, and the
``LoraConfig`` and base dtype each worker passes to :class:`~lightning_parallel.hf.HFCausalLM`.

Settings (``PeftConf``): ``peft.r``, ``peft.alpha``, ``peft.dropout``, ``peft.target_modules`` (null: peft's
``all-linear``, every linear layer but the output head) and ``peft.base_dtype`` (null: the base as loaded).
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from lightning_parallel.recipes.config import PeftConf

METHODS = ("none", "lora")
BASE_DTYPES = ("float32", "bfloat16", "float16")
ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head


def wants_lora(cfg: DictConfig) -> bool:
    """``peft=lora`` (a config without the group, as an older run's, trains every weight)."""
    return "peft" in cfg and cfg.peft.method == "lora"


def check_peft_settings(cfg: DictConfig) -> None:
    """The group's own values: a known method, no LoRA key set under ``peft=none``, sizes in range.

    Raises:
        ValueError: naming the ``peft.key=value`` and the fix.
    """
    if "peft" not in cfg:
        return
    p = cfg.peft
    if p.method not in METHODS:
        raise ValueError(f"peft.method={p.method!r} is unknown: use peft=none or peft=lora (the one method supported).")
    if p.method == "none":
        defaults = PeftConf()
        changed = [k for k in ("r", "alpha", "dropout", "target_modules", "base_dtype") if p[k] != getattr(defaults, k)]
        if changed:
            raise ValueError(
                f"peft.{changed[0]}={p[changed[0]]} applies to LoRA adapters, and peft=none trains every weight: add "
                "peft=lora, or drop the override."
            )
        return
    if p.r < 1:
        raise ValueError(f"peft.r={p.r} is not a rank: set peft.r to 1 or more (8 and 16 are usual).")
    if p.alpha <= 0:
        raise ValueError(f"peft.alpha={p.alpha} must be positive (the adapters are scaled by alpha / r): e.g. 16.")
    if not 0 <= p.dropout < 1:
        raise ValueError(f"peft.dropout={p.dropout} is not a probability: set 0 <= peft.dropout < 1.")
    if p.base_dtype is not None and p.base_dtype not in BASE_DTYPES:
        raise ValueError(f"peft.base_dtype={p.base_dtype!r} is unknown: use one of {', '.join(BASE_DTYPES)} or null.")
    targets = p.target_modules
    if not (targets is None or isinstance(targets, str) or _is_names(targets)):
        raise ValueError(
            f"peft.target_modules={targets} must be a list of module names (peft.target_modules=[q_proj,v_proj]), a "
            f"regex, {ALL_LINEAR} or null."
        )


def _is_names(value: Any) -> bool:
    return isinstance(value, (list, ListConfig)) and len(value) > 0 and all(isinstance(v, str) for v in value)


def lora_config(p: DictConfig, model: nn.Module) -> Any:
    """The ``peft.LoraConfig`` of ``peft=lora`` for ``model`` (GPT-2's ``Conv1D`` layers store their weight
    transposed: ``fan_in_fan_out`` is set for them, as peft would with a warning)."""
    from peft import LoraConfig
    from transformers.pytorch_utils import Conv1D

    targets = p.target_modules
    targets = ALL_LINEAR if targets is None else OmegaConf.to_object(targets) if _is_names(targets) else targets
    return LoraConfig(
        r=p.r,
        lora_alpha=p.alpha,
        lora_dropout=p.dropout,
        target_modules=targets,
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
    )


def base_dtype_kwargs(p: DictConfig) -> dict[str, torch.dtype]:
    """``HFCausalLM(base_dtype=...)`` when ``peft.base_dtype`` is set, else nothing (the base as loaded)."""
    return {} if p.base_dtype is None else {"base_dtype": getattr(torch, p.base_dtype)}


# ``peft.target_modules`` names for ``model=litgpt`` -> litgpt.lora.Config's flags; null: every linear of the blocks
LITGPT_TARGETS = {name: f"lora_{name}" for name in ("query", "key", "value", "projection", "mlp", "head")}
LITGPT_DEFAULT = ("query", "key", "value", "projection", "mlp")


def litgpt_lora_settings(p: DictConfig) -> dict[str, Any]:
    """``LitGPTCausalLM(lora=...)``'s settings (LitGPT's own names) for ``peft=lora``: ``peft.target_modules`` names
    LitGPT's adapted layers (query, key, value, projection, mlp, head; null: all but the head).

    Raises:
        ValueError: a target LitGPT does not adapt, or ``peft.base_dtype`` (not taken by LitGPT's LoRA yet).
    """
    if p.base_dtype is not None:
        raise ValueError(
            f"peft.base_dtype={p.base_dtype} with model=litgpt is not supported yet (the frozen base keeps its dtype): "
            "set peft.base_dtype=null, or use model=hf*."
        )
    targets = p.target_modules
    names = list(LITGPT_DEFAULT) if targets is None else OmegaConf.to_object(targets) if _is_names(targets) else None
    unknown = sorted(set(names or [targets]) - set(LITGPT_TARGETS))
    if names is None or unknown:
        raise ValueError(
            f"peft.target_modules={targets} with model=litgpt: LitGPT's LoRA adapts {list(LITGPT_TARGETS)} by name "
            f"(not {unknown}); e.g. peft.target_modules=[query,value], or null for {list(LITGPT_DEFAULT)}."
        )
    return {"lora_r": p.r, "lora_alpha": p.alpha, "lora_dropout": p.dropout, **{LITGPT_TARGETS[n]: True for n in names}}


def refuse_lora(cfg: DictConfig, model: str) -> None:
    """``peft=lora`` with a model that takes no adapters here yet."""
    if wants_lora(cfg):
        raise ValueError(
            f"peft=lora with model={model} is not supported yet: LoRA adapters train on model=hf* (HFCausalLM) and "
            "model=litgpt (LitGPTCausalLM) for now; use model=hf_llama_tiny, model=hf model.path=FOLDER or "
            "model=litgpt, or peft=none."
        )
