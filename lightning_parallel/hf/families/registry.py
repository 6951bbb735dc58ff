"""The Hugging Face families this package splits, one :class:`HFFamily` per ``config.model_type``: its
tensor-parallel plan, its pipeline layers, the attention masks a pipeline stage rebuilds, the forward extras the
pipeline layers apply, and whether it takes cp and ep. A model whose ``model_type`` has no entry is refused by name,
listing the registered ones and how to register it (:func:`register_hf_family`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.parallel.mesh import ParallelDims

# a forward extra: (the pipeline layer whose output it changes, "embedding" or "head"; what HF's forward does to that
# output, given the module it reads the value from: the head model for the head, the base model for the embedding)
Extra = tuple[str, Callable[[nn.Module, Tensor], Tensor]]
# a mask builder, called as transformers.masking_utils' builders are: (config, hidden, padding, None, position_ids=)
MaskBuilder = Callable[..., Any]
# the masks a stage rebuilds for transformers' two attention types: masking_utils' builders, by name
DEFAULT_MASKS: Mapping[str, str | MaskBuilder] = MappingProxyType(
    {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}
)


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face family: what the parallel protocol of ``HFCausalLM`` (and :func:`hf_tensor_parallel_plan`,
    :func:`hf_pipeline_layers`) asks of a model of that ``config.model_type``.

    Attributes:
        model_type: ``config.model_type`` (``"llama"``, ``"gpt2"``, ...): the registry's key.
        tp_plan: ``(model, family, sequence_parallel) -> {path: ParallelStyle}``, paths relative to the
            ``*ForCausalLM`` model (under tp > 1).
        layers: ``(model, family) -> [modules]``: the pipeline layers in forward order, each able to run on the
            previous one's output alone (hooks installed once; inert under HF's own forward).
        masks: attention type (``config.layer_types``) -> how a pipeline stage rebuilds its mask: a function of
            ``transformers.masking_utils`` by name, or a callable with their arguments. Layers of another type are
            refused under pp > 1.
        extras: config field -> :data:`Extra`: what HF's forward applies between the pipeline layers (Gemma 2's
            logit softcapping), applied by the layer holding it. A field of ``FORWARD_EXTRAS`` set away from its
            neutral value and missing here is refused under pp > 1.
        rotary_per_type: the base model's rotary module takes the attention type (``layer_type=``: Gemma 3's
            tables per type).
        context: cp > 1 taken: the attention goes through transformers' ``AttentionInterface``.
        experts: ep > 1 taken: the MoE experts of ``config.base_model_ep_plan`` split over ep.
        base_tp_plan: the base model's tensor-parallel plan in HF's style names (``"colwise"``, ``"rowwise"``,
            ``"replicated_with_grad_allreduce"``, ...) where its config gives none or too little (read by
            ``described_plan``); None: ``config.base_model_tp_plan``.
        base_pp_plan: (embedding, decoder layers, final norm): their names in the base model where its config gives
            no ``base_model_pp_plan`` (read by ``described_plan`` and ``described_layers``); None: the config's.
        check: the family's own refusals of the degrees, ``(model, dims) -> None`` raising ValueError; None: none.
    """

    model_type: str
    tp_plan: Callable[[nn.Module, HFFamily, bool], dict[str, ParallelStyle]]
    layers: Callable[[nn.Module, HFFamily], list[nn.Module]]
    masks: Mapping[str, str | MaskBuilder] = field(default_factory=lambda: dict(DEFAULT_MASKS))
    extras: Mapping[str, Extra] = field(default_factory=dict)
    rotary_per_type: bool = False
    context: bool = True
    experts: bool = False
    base_tp_plan: Mapping[str, str] | None = None
    base_pp_plan: tuple[str, str, str] | None = None
    check: Callable[[nn.Module, ParallelDims], None] | None = None

    def mask_builder(self, attention_type: str) -> MaskBuilder:
        """The function that builds the mask of ``attention_type`` layers (transformers is imported here)."""
        builder = self.masks[attention_type]
        if callable(builder):
            return builder
        from transformers import masking_utils

        return getattr(masking_utils, builder)


HF_FAMILIES: dict[str, HFFamily] = {}


def register_hf_family(family: HFFamily, *, replace: bool = False) -> HFFamily:
    """Add ``family`` to the registry under its ``model_type`` (``HFCausalLM`` then splits such models).

    Args:
        family: the entry; ``described_family("my_type")`` (:mod:`lightning_parallel.hf.families.described`) for a
            family whose config carries ``base_model_tp_plan`` and ``base_model_pp_plan`` as Llama's does.
        replace: allow replacing an entry already registered under that ``model_type``.

    Raises:
        TypeError: not an :class:`HFFamily`.
        ValueError: a ``model_type`` registered already (without ``replace=True``).
    """
    if not isinstance(family, HFFamily):
        raise TypeError(f"register_hf_family takes an HFFamily, not {type(family).__name__}.")
    if family.model_type in HF_FAMILIES and not replace:
        raise ValueError(
            f"register_hf_family: model_type {family.model_type!r} is registered already: pass replace=True to "
            "replace its entry."
        )
    HF_FAMILIES[family.model_type] = family
    return family


def _why_not_described(config: Any) -> str:
    """What the config lacks to be taken as Llama's is (empty when it carries both plans)."""
    name = type(config).__name__
    pp_plan = list(getattr(config, "base_model_pp_plan", None) or {})
    if len(pp_plan) != 3:
        return f"config.base_model_pp_plan of {name} lists {pp_plan}, not (embedding, layers, norm)"
    if not getattr(config, "base_model_tp_plan", None):
        return f"{name} has no config.base_model_tp_plan"
    return ""


def hf_family(model: nn.Module | Any) -> HFFamily:
    """The registered family of a Hugging Face model (or of its config, or of a ``model_type``).

    Raises:
        ValueError: a ``model_type`` with no entry, naming the registered ones and how to register it.
    """
    config = model if isinstance(model, str) else getattr(model, "config", model)
    model_type = config if isinstance(config, str) else getattr(config, "model_type", None)
    if model_type in HF_FAMILIES:
        return HF_FAMILIES[model_type]
    why = "" if isinstance(config, str) else _why_not_described(config)
    how = (
        f"{why}: give what it lacks in HF's style names, register_hf_family(described_family({model_type!r}, "
        "base_tp_plan={...}, base_pp_plan=(embedding, layers, norm))), or write its own tp_plan and layers in an "
        "HFFamily"
        if why
        else f"it is built like Llama (its config carries both plans): register_hf_family(described_family("
        f"{model_type!r})) (lightning_parallel.hf), once it trains to parity"
    )
    raise ValueError(
        f"Hugging Face model_type {model_type!r} is not a registered family: this package splits "
        f"{', '.join(sorted(HF_FAMILIES))}. To add it: {how}. (docs/huggingface.md, 'A family of your own')"
    )
