"""DPO on LitGPT's ``GPT`` (:class:`~lightning_parallel.litgpt.LitGPTCausalLM`), and what the preference code asks of
a model whichever library it comes from.

- adapters: a LitGPTCausalLM with LoRA holds ``litgpt.lora.GPT``'s ``LoRALinear`` / ``LoRAQKVLinear`` layers (with
  ``r = 0`` where a layer is not adapted); LitGPT has no switch for them, but each layer's forward is the base
  ``linear`` alone when its rank is 0 ("LoRA is disabled", ``litgpt/lora.py``'s ``LoRALinear.forward``), so the
  reference (the base alone) is the policy with every layer's ``r`` set to 0 for the forward: no second copy;
- the frozen copy: LitGPT's ``GPT.forward`` takes the token ids alone and returns the logits (no attention mask: its
  attention is causal and the pairs are padded on the right, after the answers, so no answer token sees padding);
- the data: LitGPT's tokenizer has no chat template but a prompt style (``prompt_style.yaml``): a preference row of
  single-turn conversations (one user message, one assistant answer each side) is read as the text of the prompt and
  the answers, as the SFT data reads them (:func:`lightning_parallel.text.samples.single_turn`).

Pure torch: litgpt is looked up in ``sys.modules`` (a model of it exists only once it is imported).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn


def is_litgpt(model: nn.Module) -> bool:
    """Whether ``model`` is LitGPT's ``GPT`` (or its LoRA subclass)."""
    litgpt_model = sys.modules.get("litgpt.model")
    return litgpt_model is not None and isinstance(model, litgpt_model.GPT)


def has_adapters(module: Any) -> bool:
    """Whether a LightningModule trains adapters on a frozen base: peft's (``HFCausalLM(peft_config=...)``) or
    LitGPT's LoRA (``LitGPTCausalLM(lora=...)``)."""
    return getattr(module, "peft_config", None) is not None or bool(getattr(module, "has_lora", False))


def litgpt_lora_layers(model: nn.Module) -> list[nn.Module]:
    """The LitGPT LoRA layers of ``model`` this rank holds that adapt something (``r > 0``)."""
    lora = sys.modules.get("litgpt.lora")
    if lora is None:
        return []
    return [m for m in model.modules() if isinstance(m, lora.LoRALayer) and m.r > 0]


@contextlib.contextmanager
def litgpt_adapters_off(model: nn.Module) -> Iterator[None]:
    """LitGPT's LoRA layers of ``model`` (those this rank holds: a pipeline stage may hold none) as their base
    ``linear`` alone for the block: each rank set to 0, as LitGPT's forward reads "LoRA disabled"; restored after."""
    layers = litgpt_lora_layers(model)
    ranks = [layer.r for layer in layers]
    for layer in layers:
        layer.r = 0
    try:
        yield
    finally:
        for layer, r in zip(layers, ranks):
            layer.r = r


def copy_logits(copy: nn.Module, ids: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    """The frozen reference copy's logits of the (2B, T) rows: LitGPT's ``GPT(ids)`` (it takes no other input), a
    Hugging Face model's ``.logits`` (its router logits off: the reference needs no load-balancing loss)."""
    if is_litgpt(copy):
        return copy(ids)
    return copy(input_ids=ids, **inputs, use_cache=False).logits


def single_turn_text(prompt: Any, chosen: Any, rejected: Any) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) conversations as text: the prompt one user message, each answer one assistant
    message.

    Raises:
        ValueError: conversations of other turns (LitGPT's prompt styles write one prompt and its answer).
    """
    turns = [[m.get("role") for m in v] for v in (prompt, chosen, rejected)]
    if turns != [["user"], ["assistant"], ["assistant"]]:
        raise ValueError(
            "data=preference with LitGPT's tokenizer (a prompt style, no chat template): the conversations have the "
            f"turns {turns} (prompt, chosen, rejected), and LitGPT's prompt styles write one user prompt and its "
            "answer: give one user message as prompt and one assistant message each side, or text columns."
        )
    return prompt[0]["content"], chosen[0]["content"], rejected[0]["content"]
