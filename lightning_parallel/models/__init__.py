"""Models the examples, tests and recipes train: a GPT-style language model and its LightningModule."""

from lightning_parallel.models.gpt import GPT, GPTConfig
from lightning_parallel.models.lit_gpt import LitGPT
from lightning_parallel.models.synthetic import SyntheticTokens

__all__ = ["GPT", "GPTConfig", "LitGPT", "SyntheticTokens"]
