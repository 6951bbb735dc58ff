"""The fine-tuning recipe's ``train(cfg, run_dir)`` (recipes/finetune.py): a Hugging Face causal LM or LitGPT's
``GPT`` with its own tokenizer on ``data=sft`` or ``data=hf_text`` (the GPT recipe's groups, checks and Trainer), its
answers to ``sample_prompts`` generated before and after training (the tokenizer, a KV cache: the library's own
generation on rank 0 with the trained weights, gathered first under a sharded layout; finetune_generate.py),
printed and saved as ``samples.json`` beside ``metrics.json``, which adds the validation loss's perplexity.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from omegaconf import DictConfig

from lightning_parallel.recipes.finetune_assets import make_default_assets
from lightning_parallel.recipes.finetune_data import tokenizer_of
from lightning_parallel.recipes.finetune_generate import answer, build_finetune_module, materialized, trained_copy

SAMPLES_FILE = "samples.json"


def check_finetune_config(cfg: DictConfig) -> None:
    """The default assets made when the config names them, then the GPT recipe's checks (which build the token
    cache), in the parent before any worker starts.

    Raises:
        ValueError: a model other than ``model=hf*`` or ``model=litgpt*``, and everything the GPT recipe refuses.
    """
    from lightning_parallel.recipes.gpt import check_config
    from lightning_parallel.recipes.model_kinds import resolve_model_kind

    if not resolve_model_kind(cfg, recipe="text").tokenized:
        raise ValueError(
            "recipes/finetune.py trains Hugging Face and LitGPT models (model=hf*, e.g. model=hf model.path=FOLDER, "
            "or model=litgpt_chat_tiny model.path=FOLDER): use recipes/train_gpt.py for the others."
        )
    refuse_optimizer(cfg.get("optimizer"), "recipes/finetune.py")
    assets = Path(cfg.assets).expanduser().resolve()
    named = [p for p in (cfg.model.path, cfg.data.path) if p is not None]
    if any(Path(p).expanduser().resolve().is_relative_to(assets) for p in named):
        make_default_assets(assets)
    check_config(cfg)


def refuse_optimizer(opt: Any, recipe: str) -> None:
    """The fine-tune and DPO recipes (``recipe``, the script named in the message) train with the model's own AdamW
    (model.lr, model.weight_decay): an ``optimizer`` group other than the default would be ignored, so it is
    refused."""
    if opt is None:
        return
    default = opt.name == "adamw" and opt.get("lr") is None and opt.get("weight_decay") is None
    if not default or list(opt.get("betas", [0.9, 0.95])) != [0.9, 0.95] or opt.get("eps", 1e-8) != 1e-8:
        raise ValueError(
            f"optimizer={opt.name} (or its lr/weight_decay/betas/eps) with {recipe}: the fine-tune recipe trains "
            "with the model's own AdamW (the DPO recipe too); set model.lr and model.weight_decay instead, or use "
            "recipes/train_gpt.py for optimizer=sgd|muon."
        )


def _before_copy(module: Any) -> Any:
    """The untrained weights, whole, for the answers before training (the module may not have read them yet)."""
    return materialized(copy.deepcopy(module))


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Fine-tune as ``cfg`` says; rank 0 prints the answers before and after, and writes ``metrics.json`` and
    ``samples.json`` into ``run_dir``. Returns the metrics."""
    from lightning_parallel.recipes.common import (
        build_trainer,
        micro_batch_size,
        resume_path,
        skip_worker_check,
        world_size,
    )
    from lightning_parallel.recipes.gpt import TextData
    from lightning_parallel.recipes.metrics import parameter_counts, run_metrics, write_metrics

    pl.seed_everything(cfg.seed, verbose=False)
    micro = micro_batch_size(cfg, world_size(cfg))
    model = build_finetune_module(cfg)
    counts = parameter_counts(model)
    trainer = build_trainer(cfg, run_dir)
    skip_worker_check(trainer, model)  # check_config ran the strategy's check on this model before launch
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
        write_answers(trained, tokenizer, cfg, before, run_dir)
    return metrics


def write_answers(trained: Any, tokenizer: Any, cfg: DictConfig, before: list[str], run_dir: Path) -> None:
    """Rank 0 after training: the trained model's answers to ``cfg.sample_prompts`` printed beside ``before`` (the
    untrained model's) and saved as samples.json in ``run_dir`` (the fine-tune and DPO recipes)."""
    prompts = list(cfg.sample_prompts)
    after = answer(trained.model, tokenizer, prompts, cfg.sample_tokens, cfg.temperature, cfg.seed)
    samples = [{"prompt": p, "before": b, "after": a} for p, b, a in zip(prompts, before, after)]
    (Path(run_dir) / SAMPLES_FILE).write_text(json.dumps(samples, indent=2))
    print("\n--- answers before -> after training ---")
    for s in samples:
        print(f"Q: {s['prompt']}\n   before: {s['before']!r}\n   after:  {s['after']!r}")
