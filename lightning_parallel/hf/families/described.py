"""Families that describe themselves as Llama does: ``config.base_model_tp_plan`` and the head's ``_tp_plan`` give the
tensor-parallel plan (:func:`~lightning_parallel.hf.plan.described_plan`), ``config.base_model_pp_plan`` the
pipeline layers (:func:`~lightning_parallel.hf.layers.described_layers`), the attention types full and sliding.
:func:`described_family` makes such an entry for a ``model_type`` of your own."""

from __future__ import annotations

from typing import Any

from lightning_parallel.hf.families.registry import HFFamily, register_hf_family
from lightning_parallel.hf.layers import described_layers
from lightning_parallel.hf.plan import described_plan


def described_family(model_type: str, **fields: Any) -> HFFamily:
    """An :class:`HFFamily` whose plan and layers are read from the config's own plans, as Llama's are.

    Args:
        model_type: ``config.model_type``.
        **fields: any other field of :class:`HFFamily` (``masks``, ``extras``, ``rotary_per_type``, ``context``,
            ``check``, or ``tp_plan`` / ``layers`` of its own).
    """
    return HFFamily(model_type, **{"tp_plan": described_plan, "layers": described_layers, **fields})


# tried (transformers 5.24): parity under pp, tp (with and without sequence parallelism), cp (Llama); Gemma,
# StarCoder2, OLMo and Helium: pipeline layers equal HF's forward, plans resolve at tp=2 (tests/test_hf_families.py)
DENSE = (
    "llama",  # grouped-query attention
    "mistral",  # sliding window on every layer
    "qwen2",  # sliding windows on the layers config.layer_types names
    "qwen3",  # per-head q/k norms: "replicated_with_grad_allreduce"
    "phi3",  # fused q/k/v and gate/up: "colwise_gather_output", "rowwise_split_input"
    "olmo2",  # norms after each sublayer, q/k norms over all heads
    "gemma",
    "starcoder2",
    "olmo",
    "helium",
    # softcaps its logits (config.final_logit_softcapping) in a forward not read here: refused under pp > 1
    "vaultgemma",
)
for _model_type in DENSE:
    register_hf_family(described_family(_model_type))
