"""The DPO recipe's ``check_dpo_config`` (in the parent, before launch) and ``train(cfg, run_dir)`` (in each worker):
the fine-tune recipe's model (a Hugging Face causal LM with its tokenizer; LoRA by default) trained on preference
pairs with DPO (:mod:`lightning_parallel.preference`). Rank 0 prints the held-out reward margin and accuracy before
and after training and the answers to ``sample_prompts``; ``metrics.json`` adds them (``dpo``) with the reference's
kind and its memory per rank.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from lightning_parallel.parallel.devices import collective_device
from lightning_parallel.preference.loss import METRICS, check_loss_settings
from lightning_parallel.preference.module import DPOSettings, as_dpo
from lightning_parallel.preference.reference import COPY_NAME, choose_reference
from lightning_parallel.recipes.dpo_data import (
    PrecomputeReference,
    PreferenceData,
    batch_group,
    make_preference_assets,
    prepare_preference_data,
    reference_memory,
)
from lightning_parallel.recipes.finetune import refuse_optimizer, write_answers
from lightning_parallel.recipes.finetune_data import tokenizer_of
from lightning_parallel.recipes.finetune_generate import answer, build_finetune_module, materialized, trained_copy
from lightning_parallel.recipes.lora import wants_lora


def dpo_settings(cfg: DictConfig) -> DPOSettings:
    """The run's :class:`DPOSettings`; the reference chosen by ``peft`` and ``dpo.precompute_reference``.

    Raises:
        ValueError: bad ``dpo.*``; a reference that cannot be built under the layout, and why.
    """
    d = cfg.dpo
    check_loss_settings(d.loss, d.beta, d.label_smoothing)
    reference = choose_reference(wants_lora(cfg), d.precompute_reference)
    return DPOSettings(beta=d.beta, loss=d.loss, label_smoothing=d.label_smoothing, reference=reference)


def check_dpo_config(cfg: DictConfig) -> None:
    """The default assets made when the config names them, the DPO settings, then the fine-tune recipe's checks with
    the preference data's (which build the token cache), before any worker starts.

    Raises:
        ValueError: a model other than ``model=hf*`` or ``model=litgpt*``; bad ``dpo.*``; what the fine-tune recipe
            refuses.
    """
    from lightning_parallel.recipes.gpt import check_config
    from lightning_parallel.recipes.model_kinds import resolve_model_kind

    kind = resolve_model_kind(cfg, recipe="text")
    if kind.name not in ("hf", "litgpt"):
        raise ValueError(
            f"recipes/dpo.py trains Hugging Face and LitGPT models (model=hf*, model=litgpt*, e.g. model=hf "
            f"model.path=FOLDER), not model.kind={kind.name}."
        )
    if cfg.data.kind != "preference":
        kind = cfg.data.kind
        raise ValueError(f"recipes/dpo.py reads data=preference (pairs), not data={kind}: set data=preference.")
    refuse_optimizer(cfg.get("optimizer"), "recipes/dpo.py")
    dpo_settings(cfg)
    assets = Path(cfg.assets).expanduser().resolve()
    named = [p for p in (cfg.model.path, cfg.data.path) if p is not None]
    if any(Path(p).expanduser().resolve().is_relative_to(assets) for p in named):
        make_preference_assets(assets)
    check_config(cfg, check_data=prepare_preference_data)


class HeldOutScores(pl.Callback):
    """The held-out pairs' loss, rewards, margin and accuracy as the training starts and as it ends (the model as
    split for training, in eval mode, without gradient): every dp rank its share of the validation batches, the sums
    reduced over the ranks reading different pairs, so global means (collective)."""

    def __init__(self) -> None:
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.before = self.scores(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.after = self.scores(trainer, pl_module)

    @torch.no_grad()
    def scores(self, trainer: pl.Trainer, module: Any) -> dict[str, float]:
        was_training = module.training
        module.eval()
        sums, batches = torch.zeros(1 + len(METRICS), dtype=torch.float64), 0
        module.scoring = True
        try:
            for index, batch in enumerate(trainer.datamodule.val_dataloader()):
                # through the strategy, as a validation step (a sharded root gathers its parameters first)
                values = trainer.strategy.validation_step(trainer.strategy.batch_to_device(batch), index)
                sums += values.double().cpu()
                batches += 1
        finally:
            module.scoring = False
        module.train(was_training)
        totals = torch.cat([sums, torch.tensor([float(batches)], dtype=torch.float64)])
        group = batch_group(trainer.strategy)
        if group is not None:
            device = collective_device(group)
            totals = totals.to(device)
            dist.all_reduce(totals, group=group)
            totals = totals.cpu()
        return {k: float(v / totals[-1]) for k, v in zip(("loss", *METRICS), totals[:-1])}


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """DPO as ``cfg`` says; rank 0 prints the held-out margin and accuracy before and after and the answers, and
    writes ``metrics.json`` and ``samples.json`` into ``run_dir``. Returns the metrics."""
    from lightning_parallel.recipes.common import (
        build_trainer,
        micro_batch_size,
        resume_path,
        skip_worker_check,
        world_size,  # noqa: I001
    )
    from lightning_parallel.recipes.metrics import all_ranks, parameter_counts, run_metrics, write_metrics

    pl.seed_everything(cfg.seed, verbose=False)
    micro = micro_batch_size(cfg, world_size(cfg))
    settings = dpo_settings(cfg)
    model = as_dpo(build_finetune_module(cfg), settings)
    counts = parameter_counts(model)
    data = PreferenceData(cfg, micro)
    precompute = PrecomputeReference(data) if settings.reference == "precomputed" else None
    scores = HeldOutScores()
    trainer = build_trainer(cfg, run_dir, callbacks=[*([precompute] if precompute else []), scores])
    skip_worker_check(trainer, model)  # check_dpo_config ran the strategy's check on this model before launch
    tokenizer = tokenizer_of(cfg)
    prompts, tokens = list(cfg.sample_prompts), cfg.sample_tokens
    asked = tokenizer is not None and prompts and tokens > 0
    before_answers = None
    if asked and trainer.global_rank == 0:
        # built again from the same seed: the same weights (a deep copy of a model waiting for its seeded init would
        # lose the modules' names it initializes by)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            untrained = materialized(build_finetune_module(cfg))
        before_answers = answer(untrained.model, tokenizer, prompts, tokens, cfg.temperature, cfg.seed)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data, ckpt_path=resume_path(cfg))
    wall = time.perf_counter() - start
    pair_tokens = cfg.data.global_batch_size * 2 * cfg.model.seq_len
    metrics = run_metrics(trainer, cfg, wall, pair_tokens, "tokens/s") | counts
    before, after = scores.before, scores.after
    memory = all_ranks(reference_memory(model, precompute))
    metrics["dpo"] = {
        "beta": settings.beta, "loss": settings.loss, "reference": settings.reference,
        "reference_bytes_per_rank": memory, "before": before, "after": after,
    }  # fmt: skip
    trained = trained_copy(trainer, model, cfg, drop=COPY_NAME) if asked else None
    write_metrics(trainer, metrics, run_dir)
    if trainer.global_rank == 0:
        print("\n--- held-out pairs: before -> after training ---")
        for key in ("margin", "accuracy", "rewards_chosen", "rewards_rejected", "loss"):
            print(f"{key:>17}: {before.get(key, float('nan')):.4f} -> {after[key]:.4f}")
        print(f"reference: {settings.reference}, {memory[0]:,} bytes on rank 0")
    if trained is not None:
        write_answers(trained, tokenizer, cfg, before_answers, run_dir)
    return metrics
