"""Pipeline layers of a Hugging Face causal LM: the model's own modules, in forward order, each able to run on
the previous one's output alone.

HF computes positions, rotary embeddings and the causal mask once at the top of the base model and passes them
to every decoder layer; between pipeline stages only the hidden state travels. So each layer is the HF module
itself (parameter and state-dict names stay HF's, any layout loads any other) with a forward pre-hook that,
when the layer is called with the hidden state alone (a pipeline stage's call; HF's own forward always passes
more), rebuilds those inputs with HF's own code (``create_causal_mask``, the model's rotary module). GPT-2's
learned positions are a layer of their own: ``wpe`` called on the token embeddings adds its rows to them.

What HF's forward computes between those modules (the forward extras: Gemma 2/3's final logit softcapping,
Cohere's ``logit_scale``, Granite's ``embedding_multiplier`` and ``logits_scaling``) is applied by hooks on the
embedding and the head, so the stage holding them applies it; under HF's own forward, which applies it itself,
they do nothing (:class:`_OwnForward`).

The microbatch's ``attention_mask`` (padded batches) and ``position_ids`` (packed ones: positions restarting at
each document, from which ``create_causal_mask`` keeps every token to its own document) reach every stage as
:func:`~lightning_parallel.parallel.pipeline.runner.stage_inputs`; without them, positions count from 0 and the
mask is causal.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.hf.context import attention_type, default_positions  # noqa: F401  (attention_type: used here)
from lightning_parallel.hf.plan import _pp_names, is_gpt2
from lightning_parallel.parallel.pipeline.runner import stage_inputs

_HOOKED = "_lightning_parallel_pipeline_hooks"


def _positions(hidden: Tensor, model: nn.Module) -> Tensor:
    """The microbatch's position ids (B, T) when the step passed them, else what HF's forward would make: 0 .. T-1
    (1, T), or under cp this rank's true positions (B, T)."""
    given = stage_inputs().get("position_ids")
    if given is not None:
        return given.to(hidden.device)
    return default_positions(model, hidden.shape[0], hidden.shape[1], hidden.device)


ATTENTION_TYPES = ("full_attention", "sliding_attention")  # what a stage can rebuild the mask of


def _decoder_inputs(model: nn.Module, rotary: nn.Module | None, index: int):
    """Pre-hook: what the base model's forward would pass decoder layer ``index``, rebuilt from the hidden state."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = model.config
    kind = attention_type(config, index)
    make_mask = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
    # rotary tables per attention type (Gemma 3) take the type
    per_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters

    def hook(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs or len(args) != 1:
            return None  # called by HF's own forward, which passes everything itself
        hidden = args[0]  # (B, T, C)
        position_ids = _positions(hidden, model)
        extra: dict[str, Any] = {"position_ids": position_ids}
        padding = stage_inputs().get("attention_mask")  # (B, T) 1 on tokens, 0 on padding; None: none
        padding = padding.to(hidden.device) if padding is not None else None
        # the mask reads positions only to find packed sequences, with a host sync (``.all()``) in every call: given
        # only when the step passed them (packing), not the default 0 .. T-1 (or a cp rank's chunks)
        given = position_ids if stage_inputs().get("position_ids") is not None else None
        # the cache goes by position: transformers 5.24 names it ``cache``, 5.17 ``past_key_values``
        extra["attention_mask"] = make_mask(config, hidden, padding, None, position_ids=given)
        if rotary is not None:
            rope_kwargs = {"layer_type": kind} if per_type else {}
            extra["position_embeddings"] = rotary(hidden, position_ids=position_ids, **rope_kwargs)
        return args, extra

    return hook


def _softcap(model: nn.Module, logits: Tensor) -> Tensor:
    cap = model.config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap  # HF's three steps, in its order


# the forward extras applied at the pipeline layers, per model type: config field -> (the layer it follows,
# what the head model's forward (the base model's, for the embedding) does to that layer's output); the forwards
# were read in transformers 5.24: other families with these fields may apply them otherwise (Falcon-H1 has more
# multipliers), so they stay refused under pp (check_hf_degrees)
Extra = tuple[str, Callable[[nn.Module, Tensor], Tensor]]
_SOFTCAP: dict[str, Extra] = {"final_logit_softcapping": ("head", _softcap)}
_LOGIT_SCALE: dict[str, Extra] = {"logit_scale": ("head", lambda model, logits: logits * model.logit_scale)}
PIPELINE_EXTRAS: dict[str, dict[str, Extra]] = {
    "gemma2": _SOFTCAP,
    "gemma3_text": _SOFTCAP,
    "cohere": _LOGIT_SCALE,
    "cohere2": _LOGIT_SCALE,
    "granite": {
        "embedding_multiplier": ("embedding", lambda base, embeds: embeds * base.embedding_multiplier),
        "logits_scaling": ("head", lambda model, logits: logits / model.config.logits_scaling),
    },
}


class _OwnForward:
    """Whether HF's own forward (the head model's or the base model's) is running: it applies the forward extras
    itself, so the layers' hooks leave them alone. A pipeline stage calls the layers outside it."""

    def __init__(self) -> None:
        self.depth = 0

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.depth += 1

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.depth -= 1

    def watch(self, *modules: nn.Module) -> None:
        for module in modules:
            module.register_forward_pre_hook(self.enter)
            module.register_forward_hook(self.leave, always_call=True)


def _install_forward_extras(model: nn.Module, base: nn.Module, embed: nn.Module, head: nn.Module) -> None:
    """Hooks on ``embed`` and ``head`` applying the model's forward extras (PIPELINE_EXTRAS) outside HF's forward."""
    extras = PIPELINE_EXTRAS.get(model.config.model_type, {})
    if not extras:
        return
    own = _OwnForward()
    own.watch(model, base)
    owners = {"embedding": (embed, base), "head": (head, model)}  # the module HF's forward reads the value from
    for where, apply in extras.values():
        layer, owner = owners[where]

        def hook(layer: nn.Module, args: tuple, output: Tensor, apply=apply, owner=owner) -> Tensor | None:
            return None if own.depth else apply(owner, output)

        layer.register_forward_hook(hook)


def _refuse_extra_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs or len(args) != 1:
        raise TypeError(
            "Under pp > 1 the first layer takes input_ids alone: pass attention_mask and position_ids as keyword "
            "arguments of self(input_ids, ...), which reach every stage (stage_inputs())."
        )


class _AddPositions:
    """GPT-2's ``wpe`` as a pipeline layer: called on the token embeddings (floating point, not position ids),
    it returns ``drop(tokens + wpe(positions))``, what GPT2Model computes before its blocks."""

    def __init__(self, drop: nn.Module, model: nn.Module) -> None:
        self.drop, self.model = drop, model
        self.tokens: Tensor | None = None

    def before(self, wpe: nn.Module, args: tuple) -> tuple | None:
        if len(args) != 1 or not torch.is_floating_point(args[0]):
            return None  # position ids: HF's own forward
        self.tokens = args[0]  # (B, T, C)
        return (_positions(args[0], self.model),)

    def after(self, wpe: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if self.tokens is None:
            return None
        tokens, self.tokens = self.tokens, None
        return self.drop(tokens + output)


def _hook_once(model: nn.Module, install) -> None:
    if not getattr(model, _HOOKED, False):
        install()
        setattr(model, _HOOKED, True)


def _llama_like_layers(model: nn.Module) -> list[nn.Module]:
    base = model.get_submodule(model.base_model_prefix)
    embed_name, layers_name, norm_name = _pp_names(model.config)
    head_names = list(getattr(type(model), "_pp_plan", None) or {"lm_head": None})  # the class: the head's own
    embed, blocks, norm = (base.get_submodule(n) for n in (embed_name, layers_name, norm_name))
    heads = [model.get_submodule(n) for n in head_names]

    def install() -> None:
        embed.register_forward_pre_hook(_refuse_extra_inputs, with_kwargs=True)
        _install_forward_extras(model, base, embed, heads[-1])
        rotary = getattr(base, "rotary_emb", None)
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(_decoder_inputs(model, rotary, index), with_kwargs=True)

    _hook_once(model, install)
    return [embed, *blocks, norm, *heads]


def _gpt2_layers(model: nn.Module) -> list[nn.Module]:
    base = model.transformer

    def install() -> None:
        base.wte.register_forward_pre_hook(_refuse_extra_inputs, with_kwargs=True)
        positions = _AddPositions(base.drop, model)
        base.wpe.register_forward_pre_hook(positions.before)
        base.wpe.register_forward_hook(positions.after)
        for index, block in enumerate(base.h):
            block.register_forward_pre_hook(_decoder_inputs(model, None, index), with_kwargs=True)

    _hook_once(model, install)
    return [base.wte, base.wpe, *base.h, base.ln_f, model.lm_head]


def hf_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """A Hugging Face ``*ForCausalLM`` model's layers in forward order, for ``pipeline_layers()``.

    From ``config.base_model_pp_plan`` (embedding, each decoder layer, final norm) and the head class's
    ``_pp_plan`` (``lm_head``); GPT-2's order is written here (token embedding, position embedding, blocks,
    final norm, head). Each runs on the previous one's output alone (hooks rebuild positions and the mask);
    under HF's own forward the hooks do nothing. Idempotent.

    Args:
        model: the HF model (its modules are returned, so they must be registered in your LightningModule).

    Raises:
        ValueError: a model without ``base_model_pp_plan`` (and not GPT-2).
    """
    return _gpt2_layers(model) if is_gpt2(model) else _llama_like_layers(model)


def num_decoder_layers(model: nn.Module) -> int:
    config = model.config
    return int(getattr(config, "num_hidden_layers", None) or config.n_layer)
