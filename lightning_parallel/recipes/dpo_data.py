"""The DPO recipe's data: its default preference set (made on first use beside the fine-tune recipe's tiny model),
the token cache built in the parent before launch (``data.cache``), the pairs every rank reads, and the reference's
log-probabilities computed before training (``dpo.precompute_reference=true``)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from omegaconf import DictConfig
from torch.utils.data import Subset

from lightning_parallel.preference.data import PreferencePairs, PreferenceSettings, build_preference_cache
from lightning_parallel.recipes.finetune_assets import instruction_pairs, make_default_assets
from lightning_parallel.recipes.finetune_data import data_cache_dir, recipe_tokenizer
from lightning_parallel.recipes.gpt import TextData
from lightning_parallel.recipes.model_kinds import kind_of

log = logging.getLogger(__name__)
PREFERENCES_FILE = "preferences.jsonl"
# the rejected answers of the default set: refusals and evasions, a style a tiny model learns to avoid from the
# pairs it sees and recognizes on held-out prompts
REFUSALS = ["I do not know.", "I cannot say.", "No idea, sorry.", "Ask someone else.", "That is not clear to me."]


def make_preference_assets(folder: str | Path) -> Path:
    """The fine-tune recipe's tiny model under ``folder`` and ``preferences.jsonl`` beside it: every instruction
    pair as a conversational preference row (TRL's explicit-prompt format), its answer chosen and a refusal rejected.
    Made once (written to a temporary file renamed into place). Returns the file."""
    folder = Path(folder).expanduser()
    make_default_assets(folder)
    path = folder / PREFERENCES_FILE
    if path.is_file():
        return path
    rows = []
    for i, (prompt, answer) in enumerate(instruction_pairs()):
        rows.append(
            {
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": REFUSALS[i % len(REFUSALS)]}],
            }
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(path)
    return path


def _settings(cfg: DictConfig, path: str) -> PreferenceSettings:
    d = cfg.data
    columns = {"prompt_column": d.prompt_column, "chosen_column": d.chosen_column, "rejected_column": d.rejected_column}
    return PreferenceSettings(path=path, seq_len=cfg.model.seq_len, format=d.format, **columns)


def prepare_preference_data(cfg: DictConfig) -> None:
    """In the parent, before any worker starts: the tokenizer, the token caches (``data.cache``, ``data.val_cache``)
    and the splits checked.

    Raises:
        ValueError: no tokenizer, bad files or columns, a pair whose prompts differ, splits smaller than a batch.
    """
    d = cfg.data
    if d.kind != "preference":
        raise ValueError(f"recipes/dpo.py reads data=preference (pairs), not data={d.kind}: set data=preference.")
    tokenizer, reason = recipe_tokenizer(cfg)
    if tokenizer is None:
        raise ValueError(f"data=preference needs a tokenizer and there is none: {reason}. Give data.tokenizer=FOLDER.")
    log.info(f"Tokenizer: {reason}.")
    if d.path is None:
        raise ValueError("data=preference needs data.path=FILE (or a folder or glob of json/jsonl/parquet/csv).")
    if not 0 < d.val_fraction < 1 and d.val_path is None:
        raise ValueError(f"data.val_fraction={d.val_fraction} must lie between 0 and 1: e.g. data.val_fraction=0.1.")
    d.cache = str(build_preference_cache(_settings(cfg, d.path), tokenizer, data_cache_dir(d)))
    if d.val_path is not None:
        d.val_cache = str(build_preference_cache(_settings(cfg, d.val_path), tokenizer, data_cache_dir(d)))
    train, val = preference_splits(cfg)
    rows = max(1, d.global_batch_size // cfg.trainer.accumulate_grad_batches)
    if len(train) < d.global_batch_size or len(val) < rows:
        raise ValueError(
            f"data.path={d.path!r} gives {len(train)} training and {len(val)} validation pairs, fewer than one "
            f"data.global_batch_size={d.global_batch_size} (validation: {rows}): give more pairs, or lower "
            "data.global_batch_size."
        )


def preference_splits(cfg: DictConfig) -> tuple[Any, Any]:
    """The training and validation pairs: ``data.val_cache``'s, else the last ``data.val_fraction`` of the pairs."""
    d, seq = cfg.data, cfg.model.seq_len
    mask = kind_of(cfg.model).attention_mask
    pairs = PreferencePairs(d.cache, seq, attention_mask=mask)
    if d.get("val_cache"):
        return pairs, PreferencePairs(d.val_cache, seq, attention_mask=mask)
    n_val = max(int(len(pairs) * d.val_fraction), max(1, d.global_batch_size // cfg.trainer.accumulate_grad_batches))
    return Subset(pairs, range(len(pairs) - n_val)), Subset(pairs, range(len(pairs) - n_val, len(pairs)))


class PreferenceData(TextData):
    """Train and validation pairs; each dp rank reads its share of every global batch of pairs (the text recipe's
    loaders over the pairs)."""

    def __init__(self, cfg: DictConfig, micro_batch: int) -> None:
        super().__init__(cfg, micro_batch, cache_dir=Path(cfg.data.cache or "."))
        self.train_set, self.val_set = preference_splits(cfg)

    def setup(self, stage: str) -> None:
        """Nothing: the pairs were read from their cache when the module was made."""


def _pairs_of(dataset: Any) -> tuple[PreferencePairs, list[int]]:
    if isinstance(dataset, Subset):
        return dataset.dataset, list(dataset.indices)
    return dataset, list(range(len(dataset)))


def batch_group(strategy: Any) -> Any:
    """The group of the ranks that read different pairs (None: one)."""
    dims = getattr(strategy, "parallel_dims", None)
    if dims is not None and getattr(strategy, "mesh", None) is not None:
        return strategy.mesh.group("batch") if dims.role_size("batch") > 1 else None
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


class PrecomputeReference(pl.Callback):
    """``dpo.precompute_reference=true``: once the model is split and before any step, the reference's log-
    probabilities of every training and validation pair (the model as it starts, adapters off under LoRA), each
    dp rank its share, gathered, then kept with the pairs (``reference_logps`` in every batch)."""

    def __init__(self, data: PreferenceData) -> None:
        self.data, self.bytes = data, 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        group = batch_group(trainer.strategy)
        for dataset in (self.data.train_set, self.data.val_set):
            pairs, _ = _pairs_of(dataset)
            if pairs.reference is None:
                logps = pl_module.precompute_reference(pairs, self.data.micro_batch, group)
                pairs.with_reference(logps)
                self.bytes += logps.numel() * logps.element_size()


def reference_memory(module: Any, callback: PrecomputeReference | None) -> int:
    """The reference's bytes on this rank (see :mod:`lightning_parallel.preference.reference`)."""
    from lightning_parallel.preference.reference import reference_bytes

    return callback.bytes if callback is not None else reference_bytes(module.dpo.reference, module, None)
