"""Models the examples, tests and recipes train: a GPT-style language model (:class:`RecipeGPT`, its
LightningModule :class:`GPTModule`) and VGG (:class:`LitVGG`). The GPT's names keep clear of LitGPT's library and of
:mod:`lightning_parallel.litgpt`; the old ``GPT`` and ``LitGPT`` still import, with a FutureWarning."""

from lightning_parallel.models.gpt import GPTConfig, RecipeGPT
from lightning_parallel.models.lit_gpt import GPTModule
from lightning_parallel.models.lit_vgg import LitVGG
from lightning_parallel.models.synthetic import SyntheticTokens
from lightning_parallel.models.vgg import VGG, VGGConfig

__all__ = ["GPTConfig", "GPTModule", "LitVGG", "RecipeGPT", "SyntheticTokens", "VGG", "VGGConfig"]

_RENAMED = {"GPT": "RecipeGPT", "LitGPT": "GPTModule"}  # old names (they read as LitGPT's library), still importable


def __getattr__(name: str) -> object:
    if name in _RENAMED:
        import warnings

        new = _RENAMED[name]
        warnings.warn(
            f"lightning_parallel.models.{name} is now {new} (the recipe's GPT, not LitGPT's): import {new}.",
            FutureWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
