"""LitGPT's ``GPT`` (``litgpt.model``) under this package's strategies: :class:`LitGPTCausalLM`, or the plan and
layers for your own LightningModule. Needs the ``litgpt`` extra; may import Lightning."""

from lightning_parallel.litgpt.layers import litgpt_pipeline_layers
from lightning_parallel.litgpt.module import LitGPTCausalLM, check_litgpt_degrees
from lightning_parallel.litgpt.plan import litgpt_tensor_parallel_plan

__all__ = ["LitGPTCausalLM", "check_litgpt_degrees", "litgpt_pipeline_layers", "litgpt_tensor_parallel_plan"]
