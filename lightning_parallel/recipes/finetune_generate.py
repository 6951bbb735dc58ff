"""The recipes' generation with the run's tokenizer, on one process holding whole weights: the answers to
``sample_prompts`` (recipes/finetune.py) and the GPT recipe's tokenized sample. Each library's own generation with
its KV cache: transformers' ``generate`` for a Hugging Face model, LitGPT's ``litgpt.generate.base.generate``
(``model.set_kv_cache``) for LitGPT's ``GPT``; greedy at ``temperature`` 0, else sampled.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig

from lightning_parallel.recipes.finetune_data import decode_new
from lightning_parallel.text import TextTokenizer


def prompt_ids(tokenizer: TextTokenizer, prompt: str) -> list[int]:
    """A prompt as the model was trained to see it: a user turn and the assistant's cue through the chat
    template when the tokenizer has one, else the text in LitGPT's prompt style (when the tokenizer is LitGPT's)
    with the tokenizer's special tokens."""
    if tokenizer.has_chat_template:
        text = tokenizer.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return tokenizer.encode([text], special=False)[0]
    return tokenizer.encode([tokenizer.render_prompt(prompt)])[0]


def _litgpt_continue(model: Any, ids: torch.Tensor, max_new_tokens: int, eos_id: int | None, temperature: float):
    """LitGPT's ``generate`` with a KV cache sized to the prompt and the answer (within the model's block_size)."""
    from litgpt.generate.base import generate

    block = model.config.block_size
    ids = ids[-(block - 1) :]  # a prompt longer than the model's context keeps its end
    total = min(len(ids) + max_new_tokens, block)
    model.max_seq_length = total
    model.set_kv_cache(batch_size=1, device=ids.device)
    try:
        out = generate(model, ids, total, temperature=temperature, eos_id=eos_id, include_prompt=False)
    finally:
        model.clear_kv_cache()
    return out.tolist()


def continue_ids(
    model: Any, tokenizer: TextTokenizer, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> list[int]:
    """The ids a model generates after ``ids`` (up to ``max_new_tokens``, the end-of-text id included when drawn).

    Args:
        model: a transformers causal LM (or peft's wrapper of one), or LitGPT's ``GPT`` (``litgpt.lora.GPT`` too),
            holding whole weights.
        tokenizer: the run's tokenizer (its end-of-text and padding ids).
        ids: the prompt's ids.
        max_new_tokens: tokens generated at most.
        temperature: 0 for greedy decoding, else the sampling temperature.
        seed: the sampling seed (the global generator is left alone).
    """
    from litgpt.model import GPT

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompt = torch.tensor(ids, device=device)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(model, GPT):
            new = _litgpt_continue(model, prompt, max_new_tokens, tokenizer.eos_id, temperature)
        else:
            sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
            out = model.generate(
                input_ids=prompt[None],
                attention_mask=torch.ones_like(prompt[None]),
                max_new_tokens=max_new_tokens,
                use_cache=True,
                pad_token_id=tokenizer.pad_id,
                eos_token_id=tokenizer.eos_id,
                **sampling,
            )
            new = out[0, len(ids) :].tolist()
    model.train(was_training)
    return new


def answer(
    model: Any, tokenizer: TextTokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, seed=0
) -> list[str]:
    """Each prompt's answer (:func:`prompt_ids`, :func:`continue_ids`), decoded up to the end-of-text token.

    Args:
        model: a transformers causal LM (or peft's wrapper of one) or LitGPT's ``GPT``, holding whole weights.
        tokenizer: the run's tokenizer.
        prompts: the questions.
        max_new_tokens: tokens generated at most per answer.
        temperature: 0 for greedy decoding, else the sampling temperature.
        seed: the sampling seed (the global generator is left alone).
    """
    new = [continue_ids(model, tokenizer, prompt_ids(tokenizer, p), max_new_tokens, temperature, seed) for p in prompts]
    return [decode_new(tokenizer, ids, 0) for ids in new]


def trained_copy(trainer: pl.Trainer, module: Any, cfg: DictConfig, drop: str | None = None) -> Any:
    """On rank 0, a single-process copy of ``module`` holding the trained weights (None on the other ranks), the
    state keys under ``drop`` (a submodule the built model lacks: DPO's reference copy) left out.
    Collective under the mesh strategies: every stage's and shard's parameters are gathered to rank 0."""
    strategy = trainer.strategy
    state = strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else module.state_dict()
    if trainer.global_rank != 0:
        return None
    if drop is not None:
        state = {k: v for k, v in state.items() if not k.startswith(drop + ".")}
    with torch.random.fork_rng(devices=[]):  # its fresh weights are overwritten
        fresh = build_finetune_module(cfg)
    materialized(fresh)
    fresh.load_state_dict({k: v.detach().cpu() for k, v in state.items()})
    return fresh


def build_finetune_module(cfg: DictConfig) -> Any:
    """The HFCausalLM or LitGPTCausalLM the config describes (what each worker trains)."""
    from lightning_parallel.recipes.model_kinds import kind_of

    return kind_of(cfg.model).build(cfg)


def materialized(module: Any) -> Any:
    """A module whose weights come late (an HFCausalLM folder read after a split, a model from a config alone
    initialized once split): here, now."""
    if hasattr(module, "materialize"):
        module.materialize()
    return module
