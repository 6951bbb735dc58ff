"""Pipeline layers of a Hugging Face causal LM: the model's own modules, in forward order, each able to run on
the previous one's output alone.

HF computes positions, rotary embeddings and the causal mask once at the top of the base model and passes them
to every decoder layer; between pipeline stages only the hidden state travels. So each layer is the HF module
itself (parameter and state-dict names stay HF's, any layout loads any other) with a forward pre-hook that,
when the layer is called with the hidden state alone (a pipeline stage's call; HF's own forward always passes
more), rebuilds those inputs with HF's own code (the family's mask builder per attention type, ``create_causal_mask``
by default, and the model's rotary module). GPT-2's learned positions are a layer of their own
(:mod:`lightning_parallel.hf.families.gpt2`).

What HF's forward computes between those modules (the forward extras: Gemma 2/3's final logit softcapping,
Cohere's ``logit_scale``, Granite's ``embedding_multiplier`` and ``logits_scaling``) is applied by hooks on the
embedding and the head, so the stage holding them applies it; under HF's own forward, which applies it itself,
they do nothing (:class:`_OwnForward`). Which model gets which layers, masks and extras is its family's entry
(:mod:`lightning_parallel.hf.families`).

The microbatch's ``attention_mask`` (padded batches) and ``position_ids`` (packed ones: positions restarting at
each document, from which ``create_causal_mask`` keeps every token to its own document) reach every stage as
:func:`~lightning_parallel.parallel.pipeline.runner.stage_inputs`; without them, positions count from 0 and the
mask is causal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from lightning_parallel.hf.context import attention_type, default_positions
from lightning_parallel.hf.plan import pp_names
from lightning_parallel.parallel.pipeline.runner import stage_inputs

if TYPE_CHECKING:
    from lightning_parallel.hf.families.registry import Extra, HFFamily

_HOOKED = "_lightning_parallel_pipeline_hooks"


def positions_of(hidden: Tensor, model: nn.Module) -> Tensor:
    """The microbatch's position ids (B, T) when the step passed them, else what HF's forward would make: 0 .. T-1
    (1, T), or under cp this rank's true positions (B, T)."""
    given = stage_inputs().get("position_ids")
    if given is not None:
        return given.to(hidden.device)
    return default_positions(model, hidden.shape[0], hidden.shape[1], hidden.device)


def decoder_inputs(model: nn.Module, rotary: nn.Module | None, index: int, family: HFFamily):
    """Pre-hook: what the base model's forward would pass decoder layer ``index``, rebuilt from the hidden state:
    the mask of its attention type by the family's builder, rotary embeddings (per attention type when the family's
    rotary module takes the type: ``family.rotary_per_type``)."""
    config = model.config
    kind = attention_type(config, index)
    per_type = rotary is not None and family.rotary_per_type

    def hook(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs or len(args) != 1:
            return None  # called by HF's own forward, which passes everything itself
        hidden = args[0]  # (B, T, C)
        position_ids = positions_of(hidden, model)
        extra: dict[str, Any] = {"position_ids": position_ids}
        padding = stage_inputs().get("attention_mask")  # (B, T) 1 on tokens, 0 on padding; None: none
        padding = padding.to(hidden.device) if padding is not None else None
        # the mask reads positions only to find packed sequences, with a host sync (``.all()``) in every call: given
        # only when the step passed them (packing), not the default 0 .. T-1 (or a cp rank's chunks)
        given = position_ids if stage_inputs().get("position_ids") is not None else None
        # the cache goes by position: transformers 5.24 names it ``cache``, 5.17 ``past_key_values``
        extra["attention_mask"] = family.mask_builder(kind)(config, hidden, padding, None, position_ids=given)
        if rotary is not None:
            rope_kwargs = {"layer_type": kind} if per_type else {}
            extra["position_embeddings"] = rotary(hidden, position_ids=position_ids, **rope_kwargs)
        return args, extra

    return hook


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


def install_forward_extras(
    model: nn.Module, base: nn.Module, embed: nn.Module, head: nn.Module, extras: Mapping[str, Extra]
) -> None:
    """Hooks on ``embed`` and ``head`` applying the family's forward ``extras`` outside HF's forward."""
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


def refuse_extra_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs or len(args) != 1:
        raise TypeError(
            "Under pp > 1 the first layer takes input_ids alone: pass attention_mask and position_ids as keyword "
            "arguments of self(input_ids, ...), which reach every stage (stage_inputs())."
        )


def hook_once(model: nn.Module, install) -> None:
    if not getattr(model, _HOOKED, False):
        install()
        setattr(model, _HOOKED, True)


def described_layers(model: nn.Module, family: HFFamily) -> list[nn.Module]:
    """The pipeline layers of a model that carries ``config.base_model_pp_plan`` (embedding, each decoder layer, final
    norm) and the head class's ``_pp_plan`` (``lm_head``), hooks installed once.

    Raises:
        ValueError: a ``base_model_pp_plan`` that is not (embedding, layers, norm).
    """
    base = model.get_submodule(model.base_model_prefix)
    embed_name, layers_name, norm_name = pp_names(model.config, family)
    head_names = list(getattr(type(model), "_pp_plan", None) or {"lm_head": None})  # the class: the head's own
    embed, blocks, norm = (base.get_submodule(n) for n in (embed_name, layers_name, norm_name))
    heads = [model.get_submodule(n) for n in head_names]

    def install() -> None:
        embed.register_forward_pre_hook(refuse_extra_inputs, with_kwargs=True)
        install_forward_extras(model, base, embed, heads[-1], family.extras)
        rotary = getattr(base, "rotary_emb", None)
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(decoder_inputs(model, rotary, index, family), with_kwargs=True)

    hook_once(model, install)
    return [embed, *blocks, norm, *heads]


def num_decoder_layers(model: nn.Module) -> int:
    config = model.config
    return int(getattr(config, "num_hidden_layers", None) or config.n_layer)
