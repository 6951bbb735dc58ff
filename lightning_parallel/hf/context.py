"""Context parallelism (cp) for Hugging Face causal LMs: attention through transformers' attention-function
interface, positions per chunk through ``position_ids``.

transformers 5.x looks each attention's kernel up by ``config._attn_implementation`` in ``ALL_ATTENTION_FUNCTIONS``
(``AttentionInterface``). Ring or Ulysses attention is registered there under a name of this model's own and the model
set to it (``set_attn_implementation``): every attention module of a family that follows the interface (Llama, Qwen2,
Mistral, Phi-3, OLMo 2, GPT-2, ...) calls it with its (B, H, T, D) queries and (B, H_kv, T, D) keys and values, rotary
embedding applied, and transformers builds no mask for an implementation it has no mask function for. Key/value heads
are repeated to the query heads first (as ``repeat_kv`` does for sdpa). Positions: a forward pre-hook on the model gives
``position_ids`` (this rank's true positions) when the caller passes none, and the pipeline stages' hooks
(:mod:`lightning_parallel.hf.layers`) take the same ones (:func:`default_positions`), so rotary (or GPT-2's learned)
positions are those of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.parallel.mesh import ParallelDims

POSITIONS_ATTR = "_lightning_parallel_cp_positions"  # positions(T, device) of this rank's tokens, set under cp
# attention keyword arguments that change the attention pattern or scores: ring and Ulysses apply none of them
UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks")
DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop")  # Llama-style, GPT-2


def attention_type(config: Any, index: int) -> str:
    """Decoder layer ``index``'s attention, as the base model's forward picks its mask: ``config.layer_types``
    when the config has them (Qwen2, Gemma 2/3), else a sliding window for every layer when
    ``config.sliding_window`` is set (Mistral), else full causal attention."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def default_positions(model: nn.Module, batch: int, length: int, device: torch.device) -> Tensor:
    """The position ids HF's forward would make without any given: this rank's true positions under cp, (B, T),
    else 0 .. T-1, (1, T)."""
    make = getattr(model, POSITIONS_ATTR, None)
    if make is None:
        return torch.arange(length, device=device).unsqueeze(0)
    return make(length, device).unsqueeze(0).expand(batch, -1)


def _give_positions(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook: ``position_ids`` of this rank's tokens when the caller gave none."""
    if kwargs.get("position_ids") is not None or getattr(model, POSITIONS_ATTR, None) is None:
        return None
    tokens = kwargs.get("input_ids", args[0] if args else None)
    tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
    return args, {**kwargs, "position_ids": default_positions(model, tokens.shape[0], tokens.shape[1], tokens.device)}


def hf_attention_function(attention: Callable[..., Tensor]) -> Callable[..., tuple[Tensor, None]]:
    """``attention(q, k, v, dropout_p, scale)`` on (B, H, T, D) as a transformers attention function."""

    def forward(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, dropout: float = 0.0,
        scaling: float | None = None, **kwargs: Any,
    ) -> tuple[Tensor, None]:  # fmt: skip
        extra = sorted(name for name in UNSUPPORTED if kwargs.get(name) is not None)
        if extra or attention_mask is not None:
            what = extra or ["an attention mask"]
            raise ValueError(
                f"{type(module).__name__} passes {', '.join(what)} to its attention: context-parallel attention is "
                "plain causal attention over the whole sequence and applies none. Use cp=1 for this model."
            )
        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # grouped-query attention: every query head gets its key/value head, as repeat_kv does
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = attention(query, key, value, dropout_p=dropout, scale=scaling)  # (B, H, T, D)
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, D), as transformers' sdpa returns it

    return forward


def hf_context_parallel(
    model: nn.Module, attention: Callable[..., Tensor], positions: Callable[..., Tensor]
) -> list[str]:
    """Point a ``PreTrainedModel``'s attention at ``attention`` (registered as an attention function) and its
    positions at ``positions``; the paths of its attention modules.

    Raises:
        TypeError: a model whose attention does not go through transformers' ``AttentionInterface``.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not model._can_set_attn_implementation():
        raise TypeError(
            f"cp > 1 needs {type(model).__name__}'s attention to go through transformers' AttentionInterface "
            "(config._attn_implementation), where the context-parallel attention is registered; this model's does "
            "not: use cp=1."
        )
    name = f"lightning_parallel_cp_{id(model)}"
    ALL_ATTENTION_FUNCTIONS.register(name, hf_attention_function(attention))
    model.set_attn_implementation(name)
    if getattr(model, POSITIONS_ATTR, None) is None:
        model.register_forward_pre_hook(_give_positions, with_kwargs=True)
    setattr(model, POSITIONS_ATTR, positions)
    return [path for path, m in model.named_modules() if type(m).__name__.endswith("Attention")]


def hf_attention_heads(config: Any) -> int:
    return int(getattr(config, "num_attention_heads", None) or config.n_head)


def check_hf_context(config: Any, layers: int, dims: ParallelDims) -> None:
    """Refuse what context-parallel attention cannot run: sliding windows, attention logit softcapping, attention
    dropout (a ValueError naming the setting and the fix)."""
    cp = dims.cp

    kinds = {attention_type(config, i) for i in range(layers)} - {"full_attention"}
    if kinds:
        raise ValueError(
            f"cp={cp} runs causal attention over the whole sequence, and this model has {sorted(kinds)} layers "
            f"(config.layer_types / config.sliding_window={getattr(config, 'sliding_window', None)}): use cp=1, or "
            "config.sliding_window=None if your sequences are no longer than the window."
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"cp={cp}: context-parallel attention applies no logit softcapping, and config.attn_logit_softcapping="
            f"{config.attn_logit_softcapping}: use cp=1."
        )
    for field in DROPOUT_FIELDS:
        if getattr(config, field, 0.0):
            raise ValueError(
                f"cp={cp}: context-parallel attention has no dropout, and config.{field}={getattr(config, field)}: "
                f"set it to 0, or cp=1."
            )
