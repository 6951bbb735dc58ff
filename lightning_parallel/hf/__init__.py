"""Hugging Face causal LMs under this package's strategies with no adapter code: :class:`HFCausalLM`, or the plan
and layers for your own LightningModule. Each ``config.model_type`` is a registered family (Llama-style models with
``base_model_tp_plan``/``base_model_pp_plan``, their MoE relatives, GPT-2; :mod:`lightning_parallel.hf.families`,
``register_hf_family`` for your own). Needs the ``hf`` extra (``pip install lightning-parallel[hf]``); may import
Lightning."""

from lightning_parallel.causal_lm import causal_lm_loss
from lightning_parallel.hf.families import (
    HFFamily,
    check_hf_degrees,
    described_family,
    hf_family,
    hf_pipeline_layers,
    hf_tensor_parallel_plan,
    register_hf_family,
)
from lightning_parallel.hf.module import HFCausalLM

__all__ = [
    "HFCausalLM",
    "HFFamily",
    "causal_lm_loss",
    "check_hf_degrees",
    "described_family",
    "hf_family",
    "hf_pipeline_layers",
    "hf_tensor_parallel_plan",
    "register_hf_family",
]
