"""Hugging Face causal LMs (Llama-style models with ``base_model_tp_plan``/``base_model_pp_plan``, and GPT-2)
under this package's strategies with no adapter code: :class:`HFCausalLM`, or the plan and layers for your own
LightningModule. Needs the ``hf`` extra (``pip install lightning-parallel[hf]``); may import Lightning."""

from lightning_parallel.causal_lm import causal_lm_loss
from lightning_parallel.hf.layers import hf_pipeline_layers
from lightning_parallel.hf.module import HFCausalLM, check_hf_degrees
from lightning_parallel.hf.plan import hf_tensor_parallel_plan

__all__ = ["HFCausalLM", "causal_lm_loss", "check_hf_degrees", "hf_pipeline_layers", "hf_tensor_parallel_plan"]
