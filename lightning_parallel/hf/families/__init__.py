"""Hugging Face families as registered entries, one per ``config.model_type`` (:class:`HFFamily`): each gives its
tensor-parallel plan, pipeline layers, the masks a stage rebuilds, the forward extras, and whether it takes cp and
ep. The built-in entries: :mod:`.described` (Llama and the families whose configs carry both plans), :mod:`.extras`
(those with forward extras: Gemma 2/3, Cohere, Granite), :mod:`.moe` (Mixtral, Qwen2/3-MoE, DeepSeek-V3),
:mod:`.gpt2`. A family of your own: ``register_hf_family(described_family("my_type"))`` when its config carries
both plans, else an :class:`HFFamily` with its own ``tp_plan`` and ``layers``.

The protocol functions here ask the model's entry: :func:`hf_tensor_parallel_plan`, :func:`hf_pipeline_layers`,
:func:`hf_expert_plan`, :func:`check_hf_degrees`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.hf.experts import ExpertStyle, hf_expert_parallel_plan
from lightning_parallel.hf.families import described, extras, gpt2, moe  # noqa: F401  (the built-in entries)
from lightning_parallel.hf.families.checks import FORWARD_EXTRAS, check_hf_degrees
from lightning_parallel.hf.families.described import described_family
from lightning_parallel.hf.families.registry import HF_FAMILIES, HFFamily, hf_family, register_hf_family
from lightning_parallel.hf.lora import base_of, has_lora_layers, lora_tensor_parallel_plan
from lightning_parallel.hf.plan import SP_WITH_PP
from lightning_parallel.parallel.pipeline.split import ElsewhereLayer

__all__ = [
    "FORWARD_EXTRAS",
    "HF_FAMILIES",
    "HFFamily",
    "check_hf_degrees",
    "described_family",
    "hf_expert_plan",
    "hf_family",
    "hf_pipeline_layers",
    "hf_tensor_parallel_plan",
    "register_hf_family",
]


def hf_tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a Hugging Face ``*ForCausalLM`` model, paths relative to it: its family's
    ``tp_plan``.

    Prefix the paths with where the model sits in your LightningModule (``{"model." + k: v ...}``).

    Args:
        model: a ``PreTrainedModel`` with a causal-LM head of a registered family, or one wrapped by peft's
            ``get_peft_model`` with LoRA: then each LoRA layer follows its base layer's split
            (:class:`~lightning_parallel.parallel.tensor.styles.LoraParallel`) and the paths are the peft model's.
        sequence_parallel: split norms and the residual stream along the sequence as well.

    Raises:
        ValueError: an unregistered family, a model with no plan, a style the translation does not know, or a LoRA
            layer it cannot split.
    """
    if sequence_parallel and any(isinstance(m, ElsewhereLayer) for m in model.modules()):
        raise ValueError(SP_WITH_PP)
    hf, prefix = base_of(model)
    family = hf_family(hf)
    plan = family.tp_plan(hf, family, sequence_parallel)
    if has_lora_layers(hf):
        plan = lora_tensor_parallel_plan(hf, plan)
    return {prefix + path: style for path, style in plan.items()}


def hf_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """A Hugging Face ``*ForCausalLM`` model's layers in forward order, for ``pipeline_layers()``: its family's
    ``layers`` (from ``config.base_model_pp_plan`` and the head's ``_pp_plan`` as Llama's; GPT-2's written in
    :mod:`.gpt2`). Each runs on the previous one's output alone (hooks rebuild positions and the mask); under HF's
    own forward the hooks do nothing. Idempotent.

    Args:
        model: the HF model (its modules are returned, so they must be registered in your LightningModule).

    Raises:
        ValueError: an unregistered family, or a model without the plan its family reads.
    """
    family = hf_family(model)
    return family.layers(model, family)


def hf_expert_plan(model: nn.Module) -> dict[str, ExpertStyle]:
    """The expert plan of a MoE family's model (``config.base_model_ep_plan``), paths relative to it; empty for a
    family without experts."""
    return hf_expert_parallel_plan(model) if hf_family(model).experts else {}
