"""Models the examples, tests and recipes train: a GPT-style language model and VGG, each with its
LightningModule."""

from lightning_parallel.models.gpt import GPT, GPTConfig
from lightning_parallel.models.lit_gpt import LitGPT
from lightning_parallel.models.lit_vgg import LitVGG
from lightning_parallel.models.synthetic import SyntheticTokens
from lightning_parallel.models.vgg import VGG, VGGConfig

__all__ = ["GPT", "GPTConfig", "LitGPT", "LitVGG", "SyntheticTokens", "VGG", "VGGConfig"]
