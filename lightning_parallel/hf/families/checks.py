"""The degrees a Hugging Face model refuses, from its family's entry and its config, before any process starts."""

from __future__ import annotations

from torch import nn

from lightning_parallel.hf.context import check_hf_context
from lightning_parallel.hf.experts import hf_expert_parallel_plan
from lightning_parallel.hf.families.registry import HF_FAMILIES, HFFamily, hf_family
from lightning_parallel.hf.layers import attention_type, num_decoder_layers
from lightning_parallel.parallel.mesh import ParallelDims

# config fields whose effect HF's forward applies between the modules of base_model_pp_plan (final logits
# softcapping: Gemma 2/3; logit_scale: Cohere; logits_scaling and embedding_multiplier: Granite), with their
# neutral values: under pp a family's entry applies those it lists in its ``extras``; other families must have the
# neutral values
FORWARD_EXTRAS = {
    "final_logit_softcapping": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "embedding_multiplier": 1.0,
}


def check_hf_degrees(model: nn.Module, dims: ParallelDims) -> None:
    """Refuse tp that does not divide the heads, key/value heads or vocabulary, pp beyond the decoder layers or
    where a stage cannot rebuild the family's forward (its masks, its extras), cp where the family or its attention
    cannot take it, ep on a model without experts; then the family's own ``check``.

    Args:
        model: the Hugging Face ``*ForCausalLM`` model (a registered family).
        dims: the mesh's degrees (``ParallelDims.of(pp=2, tp=2)`` for a check of a few).

    Raises:
        ValueError: naming the setting and the fix (or the unregistered ``model_type``).
    """
    family = hf_family(model)
    _check_tp(model, dims.tp)
    layers = num_decoder_layers(model)
    if dims.pp > 1:
        _check_pipeline(model, family, dims.pp, layers)
    if dims.pp > layers:
        raise ValueError(
            f"pp={dims.pp} is more pipeline stages than the model's {layers} decoder layers: use pp <= {layers}."
        )
    if dims.cp > 1:
        if not family.context:
            raise ValueError(
                f"cp={dims.cp}: the {family.model_type} family's attention does not take context parallelism here "
                "(HFFamily.context=False): use cp=1."
            )
        check_hf_context(model.config, layers, dims)
    if dims.ep > 1 and not (family.experts and hf_expert_parallel_plan(model)):
        raise ValueError(
            f"ep={dims.ep} splits the experts of MoE models, and this {model.config.model_type} model has none (no "
            "config.base_model_ep_plan): set ep=1."
        )
    if family.check is not None:
        family.check(model, dims)


def _check_tp(model: nn.Module, tp: int) -> None:
    config = model.config
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "vocab_size": config.vocab_size,
    }
    for name, size in sizes.items():
        if tp > 1 and size % tp:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            raise ValueError(
                f"tp={tp} does not divide the model's {name}={size}: choose tp among {divisors}"
                + (" (or pad the vocabulary: resize_token_embeddings)." if name == "vocab_size" else ".")
            )


def _check_pipeline(model: nn.Module, family: HFFamily, pp: int, layers: int) -> None:
    config = model.config
    for name, neutral in FORWARD_EXTRAS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral and name not in family.extras:
            applied = sorted(t for t, f in HF_FAMILIES.items() if name in f.extras)
            raise ValueError(
                f"pp={pp} cannot split a {config.model_type} model whose config.{name}={value!r}: its forward "
                "applies it outside the modules base_model_pp_plan lists, and the pipeline layers apply it for "
                f"{', '.join(applied) or 'no registered family'} only (HFFamily.extras). Use pp=1 (tp and ZeRO run "
                f"HF's own forward), or {name}={neutral!r} if the model was trained without it."
            )
    kinds = {attention_type(config, i) for i in range(layers)} - set(family.masks)
    if kinds:
        raise ValueError(
            f"pp={pp} cannot rebuild the attention mask of {sorted(kinds)} layers (config.layer_types) at a stage "
            f"start (the {family.model_type} family rebuilds {', '.join(family.masks)}: HFFamily.masks): use pp=1."
        )
