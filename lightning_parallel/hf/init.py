"""How a Hugging Face model built from its config alone is initialized: each module by Hugging Face's own
``_init_weights`` (of the ``PreTrainedModel`` it belongs to, as ``initialize_weights`` dispatches it), one module at a
time once the model is split (:class:`~lightning_parallel.parallel.materialize.SeededInit`), as transformers
initializes the weights a checkpoint lacks after building the model on the meta device."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def hf_init_weights(model: nn.Module) -> Callable[[nn.Module], None]:
    """``init(module)``: the ``_init_weights`` of the innermost ``PreTrainedModel`` holding ``module`` in ``model``
    (the tensors ``module`` owns; a module outside ``model``: the model's own)."""
    from transformers import PreTrainedModel

    nearest: dict[int, Callable[[nn.Module], None]] = {}

    def walk(module: nn.Module, init: Callable[[nn.Module], None]) -> None:
        if isinstance(module, PreTrainedModel):
            init = module._init_weights
        nearest[id(module)] = init
        for child in module.children():
            walk(child, init)

    walk(model, model._init_weights)

    def init(module: nn.Module) -> None:
        nearest.get(id(module), model._init_weights)(module)

    return init
