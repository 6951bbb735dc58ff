"""Families whose forward applies something between the modules ``base_model_pp_plan`` lists (the forward extras),
each applied under pp by the pipeline layer that holds it: Gemma 2/3's final logit softcapping, Cohere's
``logit_scale``, Granite's ``embedding_multiplier`` and ``logits_scaling``. Read in transformers 5.24's forwards:
other families with these fields may apply them otherwise (Falcon-H1 has more multipliers)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_parallel.hf.families.described import described_family
from lightning_parallel.hf.families.registry import Extra, register_hf_family


def _softcap(model: nn.Module, logits: Tensor) -> Tensor:
    cap = model.config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap  # HF's three steps, in its order


SOFTCAP: dict[str, Extra] = {"final_logit_softcapping": ("head", _softcap)}
LOGIT_SCALE: dict[str, Extra] = {"logit_scale": ("head", lambda model, logits: logits * model.logit_scale)}
GRANITE: dict[str, Extra] = {
    "embedding_multiplier": ("embedding", lambda base, embeds: embeds * base.embedding_multiplier),
    "logits_scaling": ("head", lambda model, logits: logits / model.config.logits_scaling),
}

register_hf_family(described_family("gemma2", extras=SOFTCAP))
# per-head q/k norms; rotary tables per attention type (its rotary module takes layer_type=)
register_hf_family(described_family("gemma3_text", extras=SOFTCAP, rotary_per_type=True))
register_hf_family(described_family("cohere", extras=LOGIT_SCALE))
register_hf_family(described_family("cohere2", extras=LOGIT_SCALE))
register_hf_family(described_family("granite", extras=GRANITE))
