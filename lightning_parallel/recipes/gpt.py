"""The GPT recipe's ``train(cfg, run_dir)``, what recipes/train_gpt.py runs in each worker process: the
module of ``model.kind``'s family (the recipe GPT's ``GPTModule`` by default) on text, trained with the strategy,
precision and checkpointing the config picks; it writes ``metrics.json`` (the fields docs/recipes.md lists) and
prints a generated sample.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel.callbacks.resume import ResumableDataLoader
from lightning_parallel.parallel.context import check_sequence, whole_sequence
from lightning_parallel.recipes.common import (
    build_trainer,
    check_run_settings,
    check_strategy_model,
    mesh_dims,
    micro_batch_size,
    recipe_names,
    resume_path,
    sampler_kwargs,
    skip_worker_check,
    world_size,
)
from lightning_parallel.recipes.finetune_data import TOKENIZED_KINDS, prepare_tokenized_data, splits
from lightning_parallel.recipes.gpt_model import MOE_KEYS, gpt_config  # noqa: F401  (their home before the registry)
from lightning_parallel.recipes.lora import check_peft_settings, refuse_lora, wants_lora
from lightning_parallel.recipes.metrics import parameter_counts, run_metrics, write_metrics
from lightning_parallel.recipes.model_kinds import kind_of, resolve_model_kind
from lightning_parallel.recipes.optimizers import check_optimizer, use_optimizer
from lightning_parallel.recipes.text_data import TokenWindows, load_tokens
from lightning_parallel.strategies.checks import as_built
from lightning_parallel.strategies.pipelined_step import PipelineInput


def check_config(cfg: DictConfig, check_data: Any = None) -> None:
    """Everything that can be refused before a worker starts: the settings of the recipe's own keys (the model
    family's, peft's, the run's, the data's: ``check_data(cfg)``, by default :func:`check_text_data`), then the
    strategy's one check of the model it will split, built on the meta device
    (:func:`~lightning_parallel.recipes.common.check_strategy_model`)."""
    kind = resolve_model_kind(cfg, recipe="text")
    check_peft_settings(cfg)
    check_optimizer(cfg)
    if not kind.lora:
        refuse_lora(cfg, cfg.model.get("name") or f"{kind.name}_*")
    kind.check(cfg)
    with recipe_names(lora=wants_lora(cfg)):
        module = kind.meta_module(cfg)  # the module the workers train, on meta; LoRA adapters included
    strategy = check_run_settings(cfg, num_layers=kind.layers(module))
    if dims := mesh_dims(cfg, strategy):
        if kind.check_layout is not None:
            kind.check_layout(cfg, dims)
        if dims.context > 1:  # two chunks of each model.seq_len window per cp rank
            check_sequence(cfg.model.seq_len, dims.cp, setting="strategy.cp")
    check_strategy_model(cfg, strategy, module, lora=wants_lora(cfg))
    if cfg.trainer.sync_batchnorm:
        raise ValueError(
            "trainer.sync_batchnorm=true: the GPT has no BatchNorm to sync, nor have the Hugging Face and LitGPT "
            "models (LayerNorm and RMSNorm need none)."
        )
    (check_data or check_text_data)(cfg)


def check_text_data(cfg: DictConfig) -> None:
    """The data file exists and holds a training and a validation window (read by its size only)."""
    d, seq = cfg.data, cfg.model.seq_len
    kind = kind_of(cfg.model)
    if d.kind in TOKENIZED_KINDS or (kind.tokenized and kind.tokenizer_folder(cfg.model) is not None):
        prepare_tokenized_data(cfg)  # the tokenizer (logged) and the token cache, or bytes when there is none
        if d.cache is not None:
            return
    if not 0 < d.val_fraction < 1:
        raise ValueError(f"data.val_fraction={d.val_fraction} must lie between 0 and 1: e.g. data.val_fraction=0.05.")
    if d.kind not in ("text", "tokens"):
        raise ValueError(f"data.kind={d.kind!r} is unknown: use data=text (a UTF-8 file) or data=tokens (uint16 ids).")
    if d.path is None:
        if d.kind == "tokens":
            raise ValueError("data=tokens needs data.path=FILE, a file of uint16 token ids.")
        return  # the default corpus, which the workers build from Python's own documentation
    file = Path(d.path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"data.path={d.path!r} is not a file: give the path of a local text or token file.")
    itemsize = 2 if d.kind == "tokens" else 1  # uint16 ids, or UTF-8 bytes
    size = file.stat().st_size
    if size % itemsize:
        raise ValueError(
            f"data.path={d.path!r} has an odd number of bytes, so it is not uint16 token ids (data=tokens): "
            "use data=text for a text file."
        )
    count = size // itemsize
    windows = max(0, (count - 1) // seq)
    if windows - max(1, int(windows * d.val_fraction)) < 1:
        raise ValueError(
            f"data.path={d.path!r} holds {count} tokens, too few for a training and a validation window of "
            f"model.seq_len={seq}: use a longer file (at least {2 * seq + 1} tokens) or a shorter model.seq_len."
        )


class TextData(pl.LightningDataModule):
    """Train and validation windows of the corpus; each dp rank reads its share of every global batch."""

    def __init__(self, cfg: DictConfig, micro_batch: int, cache_dir: Path) -> None:
        super().__init__()
        self.cfg, self.micro_batch, self.cache_dir = cfg, micro_batch, cache_dir

    def setup(self, stage: str) -> None:
        if self.cfg.data.get("cache"):  # tokenized by the parent (finetune_data.py)
            self.train_set, self.val_set = splits(self.cfg)
            return
        tokens = load_tokens(self.cfg.data.kind, self.cfg.data.path, self.cache_dir)
        kind = kind_of(self.cfg.model)
        vocab = kind.vocab_size(self.cfg.model)
        if self.cfg.data.kind == "tokens" and int(tokens.max()) >= vocab:
            raise ValueError(
                f"data.path holds token id {int(tokens.max())} >= model.vocab_size={vocab}: "
                "set model.vocab_size to the tokenizer's vocabulary size."
            )
        seq, frac = self.cfg.model.seq_len, self.cfg.data.val_fraction
        # HF and LitGPT modules take labels unshifted (they shift them): (inputs, inputs), T - 1 targets a window
        same = kind.labels_are_inputs
        self.train_set = TokenWindows(tokens, seq, "train", frac, labels_are_inputs=same)
        self.val_set = TokenWindows(tokens, seq, "val", frac, labels_are_inputs=same)

    def _loader(self, dataset: TokenWindows, shuffle: bool) -> DataLoader:
        kwargs = sampler_kwargs(self.trainer)
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=self.cfg.seed, drop_last=True, **kwargs)
        loader = ResumableDataLoader if shuffle else DataLoader  # training: a mid-epoch resume continues the epoch
        return loader(
            dataset, batch_size=self.micro_batch, sampler=sampler, num_workers=self.cfg.data.num_workers, drop_last=True
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


@torch.no_grad()
def generate(
    model: pl.LightningModule, prompt: bytes, tokens: int, temperature: float = 0.8, seed: int = 0, seq_len: int = 0
) -> bytes:
    """A sampled continuation of ``prompt`` (``temperature`` 0: greedy), runnable under every layout
    (collective under pp and tp). Every rank draws the same bytes: the logits are whole on every rank and
    the generator is seeded alike. Only byte ids are drawn; ``seq_len`` 0: the model's own."""
    seq_len = seq_len or model.config.seq_len
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    for _ in range(tokens):
        with whole_sequence(model):  # cp: the prompt is not split, every cp rank runs all of it
            out = model(idx[:, -seq_len:])
            # under pp the forward runs here, when the pipeline's input is made: inside, so cp leaves it whole too
            logits = out.materialize() if isinstance(out, PipelineInput) else out
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        last = logits[:, -1, :256].float().cpu()  # (1, 256): byte ids only (a larger vocabulary has more)
        if temperature <= 0:
            token = last.argmax(-1, keepdim=True)
        else:
            token = torch.multinomial(torch.softmax(last / temperature, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, token.to(idx.device)], dim=1)
    return bytes(idx[0].tolist())


def tokenized_sample(trainer: pl.Trainer, model: pl.LightningModule, cfg: DictConfig) -> str | None:
    """A greedy continuation of "The " with the run's tokenizer, on rank 0 (collective: the weights are gathered)."""
    from lightning_parallel.recipes.finetune_data import decode_new, tokenizer_of
    from lightning_parallel.recipes.finetune_generate import continue_ids, trained_copy

    trained = trained_copy(trainer, model, cfg)
    if trained is None:
        return None
    tokenizer = tokenizer_of(cfg)
    new = continue_ids(trained.model, tokenizer, tokenizer.encode(["The "])[0], cfg.sample_tokens)
    return "The " + decode_new(tokenizer, new, 0)


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the metrics written to ``run_dir/metrics.json`` (by rank 0)."""
    pl.seed_everything(cfg.seed, verbose=False)
    micro = micro_batch_size(cfg, world_size(cfg))
    m = cfg.model
    kind = kind_of(m)
    model = kind.build(cfg)  # a folder's weights are read after the split; fresh ones seeded alike
    with torch.device("meta"):  # a model built in configure_model: count the same one, allocating nothing
        built = as_built(model)
        counts = parameter_counts(built if built is not None else model)
    use_optimizer(model, cfg)  # optimizer=adamw|sgd|muon in place of the model's own
    trainer = build_trainer(cfg, run_dir)
    skip_worker_check(trainer, model)  # check_config ran the strategy's check on this model before launch
    data = TextData(cfg, micro, cache_dir=Path.cwd() / "data")  # the default corpus is written there once
    start = time.perf_counter()
    trainer.fit(model, datamodule=data, ckpt_path=resume_path(cfg))
    wall = time.perf_counter() - start
    metrics = run_metrics(trainer, cfg, wall, cfg.data.global_batch_size * m.seq_len, "tokens/s") | counts
    if cfg.sample_tokens > 0 and cfg.data.get("cache"):  # tokenized: the tokenizer's text
        metrics["sample"] = tokenized_sample(trainer, model, cfg)
    elif cfg.sample_tokens > 0:
        sample = generate(model, b"The ", cfg.sample_tokens, seed=cfg.seed, seq_len=m.seq_len)
        metrics["sample"] = sample.decode("utf-8", errors="replace")
    write_metrics(trainer, metrics, run_dir)
    if trainer.global_rank == 0 and "sample" in metrics:
        print(f"\n--- sample ---\n{metrics['sample']}\n--------------")
    return metrics
