"""The fine-tuning recipe's ``train(cfg, run_dir)`` (recipes/finetune.py): a Hugging Face causal LM with its own
tokenizer on ``data=sft`` or ``data=hf_text`` (the GPT recipe's groups, checks and Trainer), its answers to
``sample_prompts`` generated before and after training (the tokenizer, a KV cache: transformers' ``generate`` on rank
0 with the trained weights, gathered first under a sharded layout), printed and saved as ``samples.json`` beside
``metrics.json``, which adds the validation loss's perplexity.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig

from lightning_parallel.recipes.finetune_assets import make_default_assets
from lightning_parallel.recipes.finetune_data import decode_new, tokenizer_of
from lightning_parallel.text import TextTokenizer

SAMPLES_FILE = "samples.json"


def check_finetune_config(cfg: DictConfig) -> None:
    """The default assets made when the config names them, then the GPT recipe's checks (which build the token
    cache), in the parent before any worker starts.

    Raises:
        ValueError: a model other than ``model=hf*``, and everything the GPT recipe refuses.
    """
    from lightning_parallel.recipes.gpt import check_config
    from lightning_parallel.recipes.hf import is_hf_model

    if not is_hf_model(cfg.model):
        raise ValueError(
            "recipes/finetune.py trains Hugging Face models (model=hf*, e.g. model=hf model.path=FOLDER): "
            "use recipes/train_gpt.py for the others."
        )
    assets = Path(cfg.assets).expanduser().resolve()
    named = [p for p in (cfg.model.path, cfg.data.path) if p is not None]
    if any(Path(p).expanduser().resolve().is_relative_to(assets) for p in named):
        make_default_assets(assets)
    check_config(cfg)


def prompt_ids(tokenizer: TextTokenizer, prompt: str) -> list[int]:
    """A prompt as the model was trained to see it: a user turn and the assistant's cue through the chat
    template when the tokenizer has one, else the text with the tokenizer's special tokens."""
    if tokenizer.has_chat_template:
        text = tokenizer.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return tokenizer.encode([text], special=False)[0]
    return tokenizer.encode([prompt])[0]


@torch.no_grad()
def answer(
    model: Any, tokenizer: TextTokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, seed=0
) -> list[str]:
    """Each prompt's answer from transformers' ``generate`` (KV cache; greedy at ``temperature`` 0), decoded up to
    the end-of-text token.

    Args:
        model: a transformers causal LM (or peft's wrapper of one) holding whole weights.
        tokenizer: the run's tokenizer.
        prompts: the questions.
        max_new_tokens: tokens generated at most per answer.
        temperature: 0 for greedy decoding, else the sampling temperature.
        seed: the sampling seed (the global generator is left alone).
    """
    was_training = model.training
    model.eval()
    answers = []
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    for prompt in prompts:
        ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=next(model.parameters()).device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                use_cache=True,
                pad_token_id=tokenizer.pad_id,
                eos_token_id=tokenizer.eos_id,
                **sampling,
            )
        answers.append(decode_new(tokenizer, out[0].tolist(), ids.shape[1]))
    model.train(was_training)
    return answers


def trained_copy(trainer: pl.Trainer, module: Any, cfg: DictConfig) -> Any:
    """On rank 0, a single-process copy of ``module`` holding the trained weights (None on the other ranks).
    Collective under the mesh strategies: every stage's and shard's parameters are gathered to rank 0."""
    strategy = trainer.strategy
    state = strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else module.state_dict()
    if trainer.global_rank != 0:
        return None
    from lightning_parallel.recipes.hf import build_hf_module

    with torch.random.fork_rng(devices=[]):  # its fresh weights are overwritten
        fresh = build_hf_module(cfg)
    fresh.materialize()
    fresh.load_state_dict({k: v.detach().cpu() for k, v in state.items()})
    return fresh


def _before_copy(module: Any) -> Any:
    """The untrained weights, whole, for the answers before training (the module may not have read them yet)."""
    before = copy.deepcopy(module)
    before.materialize()
    return before


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Fine-tune as ``cfg`` says; rank 0 prints the answers before and after, and writes ``metrics.json`` and
    ``samples.json`` into ``run_dir``. Returns the metrics."""
    from lightning_parallel.recipes.common import (
        build_trainer,
        micro_batch_size,
        parameter_counts,
        resume_path,
        run_metrics,
        world_size,
        write_metrics,
    )
    from lightning_parallel.recipes.gpt import TextData
    from lightning_parallel.recipes.hf import build_hf_module

    pl.seed_everything(cfg.seed, verbose=False)
    micro = micro_batch_size(cfg, world_size(cfg))
    model = build_hf_module(cfg)
    counts = parameter_counts(model)
    trainer = build_trainer(cfg, run_dir)
    tokenizer = tokenizer_of(cfg)
    prompts, tokens = list(cfg.sample_prompts), cfg.sample_tokens
    asked = tokenizer is not None and prompts and tokens > 0
    before = None
    if asked and trainer.global_rank == 0:
        before = answer(_before_copy(model).model, tokenizer, prompts, tokens, cfg.temperature, cfg.seed)
    data = TextData(cfg, micro, cache_dir=Path.cwd() / "data")
    start = time.perf_counter()
    trainer.fit(model, datamodule=data, ckpt_path=resume_path(cfg))
    wall = time.perf_counter() - start
    metrics = run_metrics(trainer, cfg, wall, cfg.data.global_batch_size * cfg.model.seq_len, "tokens/s") | counts
    val = metrics["final_val_loss"]
    metrics["val_perplexity"] = math.exp(val) if val is not None and val < 50 else None
    trained = trained_copy(trainer, model, cfg) if asked else None
    write_metrics(trainer, metrics, run_dir)
    if trained is not None:
        after = answer(trained.model, tokenizer, prompts, tokens, cfg.temperature, cfg.seed)
        samples = [{"prompt": p, "before": b, "after": a} for p, b, a in zip(prompts, before, after)]
        (Path(run_dir) / SAMPLES_FILE).write_text(json.dumps(samples, indent=2))
        print("\n--- answers before -> after training ---")
        for s in samples:
            print(f"Q: {s['prompt']}\n   before: {s['before']!r}\n   after:  {s['after']!r}")
    return metrics
