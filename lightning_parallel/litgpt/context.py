"""Context parallelism (cp) for LitGPT's ``GPT``: its attention and rotary positions per chunk.

Each ``CausalSelfAttention`` computes its scores in ``scaled_dot_product_attention(q, k, v, mask)`` on (B, H, T, D)
queries and keys and values already repeated to the query heads; under cp that method is replaced, on each attention
module, by the context-parallel attention at LitGPT's own scale. ``GPT.forward`` (and a pipeline stage's hook,
:mod:`lightning_parallel.litgpt.layers`) give every block the first T rows of the rotary tables ``GPT.cos`` /
``GPT.sin``; a forward pre-hook on each block gives it instead the rows of this rank's true positions (the rope cache
indexed by them, with the block's ``rope_indices`` where the config has them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_parallel.parallel.mesh import ParallelDims

_POSITIONS = "_lightning_parallel_cp_positions"


def _scale(config: Any, attention: nn.Module) -> float:
    """LitGPT's score scale (``CausalSelfAttention.scaled_dot_product_attention``)."""
    return 1.0 / math.sqrt(config.attention_scores_scalar or config.head_size) * attention.mscale * attention.mscale


def _attention_method(module: nn.Module, attention: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is not None:
            raise ValueError(
                "LitGPT's attention got a mask (a KV cache or sliding window) under cp: context-parallel attention is "
                "causal over the whole sequence only. Use cp=1 for generation with a KV cache."
            )
        out = attention(q, k, v, scale=_scale(module.config, module))  # (B, H, T, D)
        return out.transpose(1, 2)  # (B, T, H, D), as LitGPT's returns it

    return scaled_dot_product_attention


def _block_positions(model: nn.Module, index: int):
    """Block pre-hook: the rotary rows of this rank's true positions instead of the first T."""

    def hook(block: nn.Module, args: tuple) -> tuple | None:
        if len(args) != 6 or args[4] is not None:  # a KV-cache forward (input_pos): positions are given
            return None
        x = args[0]  # (B, T, C)
        positions = getattr(model, _POSITIONS)(x.shape[1], x.device)  # (T,)
        cos, sin = model.cos[positions].unsqueeze(0), model.sin[positions].unsqueeze(0)  # (1, T, rope_n_elem)
        indices = model.config.rope_indices
        if indices is not None:
            cos, sin = cos[..., indices[index]], sin[..., indices[index]]
        return (x, cos, sin, *args[3:])

    return hook


def litgpt_context_parallel(
    model: nn.Module, attention: Callable[..., Tensor], positions: Callable[..., Tensor]
) -> list[str]:
    """Point a LitGPT ``GPT``'s attention at ``attention`` and its rotary positions at ``positions``; the paths of
    the attention modules switched."""
    first = getattr(model, _POSITIONS, None) is None
    setattr(model, _POSITIONS, positions)
    switched = []
    for index, block in enumerate(model.transformer.h):
        if not hasattr(block, "attn"):  # under pp: another stage's block, a placeholder here
            continue
        block.attn.scaled_dot_product_attention = _attention_method(block.attn, attention)
        if first:  # after the pipeline hook (registered at build): it rebuilds the first T rows, this one replaces them
            block.register_forward_pre_hook(_block_positions(model, index))
        switched.append(f"transformer.h.{index}.attn")
    return switched


def check_litgpt_context(config: Any, dims: ParallelDims) -> None:
    """Refuse what context-parallel attention cannot run on a LitGPT model (a ValueError naming the setting)."""
    refused = {
        "latent_attention": config.latent_attention is not None,
        "sliding_window_size": config.sliding_window_size is not None and any(config.sliding_window_indices or ()),
        "attention_logit_softcapping": config.attention_logit_softcapping is not None,
    }
    for name, on in refused.items():
        if on:
            raise ValueError(
                f"cp={dims.cp} cannot run a LitGPT model with config.{name}={getattr(config, name)!r}: "
                "context-parallel attention is plain causal attention over the whole sequence. Use cp=1."
            )
