"""The GPT recipe's ``train(cfg, run_dir)``, what recipes/train_gpt.py runs in each worker process: a
LitGPT on byte-level text, trained with the strategy, precision and checkpointing the config picks; it
writes ``metrics.json`` (the fields docs/recipes.md lists) and prints a generated sample.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.callbacks.resume import ResumableDataLoader
from lightning_parallel.hf.layers import hf_pipeline_layers
from lightning_parallel.models import GPTConfig, LitGPT
from lightning_parallel.models.gpt import GPT
from lightning_parallel.parallel.context import check_heads, check_sequence, whole_sequence
from lightning_parallel.recipes.common import (
    build_trainer,
    check_run_settings,
    micro_batch_size,
    resume_path,
    sampler_kwargs,
    world_size,
)
from lightning_parallel.recipes.config import GPTModelConf
from lightning_parallel.recipes.finetune_data import TOKENIZED_KINDS, is_library_model, prepare_tokenized_data, splits
from lightning_parallel.recipes.hf import (
    build_hf_module,
    check_hf_layout,
    check_hf_model,
    is_hf_model,
    model_vocab_size,
)
from lightning_parallel.recipes.litgpt import (
    build_litgpt_module,
    check_litgpt_layout,
    check_litgpt_model,
    is_litgpt_model,
    litgpt_config,
)
from lightning_parallel.recipes.lora import (
    check_hf_lora,
    check_litgpt_lora,
    check_peft_settings,
    refuse_lora,
    wants_lora,
)
from lightning_parallel.recipes.metrics import parameter_counts, run_metrics, write_metrics
from lightning_parallel.recipes.optimizers import check_optimizer, use_optimizer
from lightning_parallel.recipes.text_data import TokenWindows, load_tokens
from lightning_parallel.strategies.pipelined_step import PipelineInput


def gpt_config(m: DictConfig) -> GPTConfig:
    return GPTConfig(
        vocab_size=m.vocab_size,
        seq_len=m.seq_len,
        n_layer=m.n_layer,
        n_head=m.n_head,
        d_model=m.d_model,
        mlp_ratio=m.mlp_ratio,
        dropout=m.dropout,
        **{key: m[key] for key in MOE_KEYS},
    )


MOE_KEYS = (
    "moe_experts",
    "moe_top_k",
    "moe_every",
    "moe_hidden",
    "moe_capacity_factor",
    "moe_shared_hidden",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
)


def check_config(cfg: DictConfig) -> None:
    """Everything that can be refused before a worker starts: names, degrees, sizes, batch splits."""
    check_peft_settings(cfg)
    check_optimizer(cfg)
    if is_hf_model(cfg.model):
        meta = check_hf_model(cfg)
        strategy = _check_library_model(cfg, meta, len(hf_pipeline_layers(meta)), check_hf_layout)
        if wants_lora(cfg):  # last: the adapters are injected into the meta model
            check_hf_lora(cfg, meta, _degrees(cfg, strategy), _sequence_parallel(strategy))
        return
    if is_litgpt_model(cfg.model):
        from lightning_parallel.litgpt import litgpt_pipeline_layers

        meta = check_litgpt_model(cfg)
        strategy = _check_library_model(cfg, meta, len(litgpt_pipeline_layers(meta)), check_litgpt_layout)
        if wants_lora(cfg):
            check_litgpt_lora(cfg, meta.config, _degrees(cfg, strategy))
        return
    refuse_lora(cfg, cfg.model.get("name", "gpt_*"))
    strategy = check_run_settings(cfg, num_layers=cfg.model.n_layer + 2)  # embedding, blocks, head
    m = cfg.model
    for key in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
        if m[key] < 1:
            raise ValueError(f"model.{key}={m[key]} must be a positive size: set model.{key} to 1 or more.")
    if not m.moe_experts:
        defaults = GPTModelConf()
        moe_set = [k for k in MOE_KEYS if k != "moe_experts" and m[k] != getattr(defaults, k)]
        if moe_set:
            raise ValueError(
                f"model.{moe_set[0]}={m[moe_set[0]]} only applies to MoE blocks, and model.moe_experts=0 makes every "
                "block dense: set model.moe_experts (or model=gpt_moe_tiny), or drop the override."
            )
    config = gpt_config(m)  # checks d_model against n_head, and the MoE settings
    if isinstance(strategy, Hybrid3DStrategy):
        dims = strategy.config.dims(world_size(cfg))
        GPT.check_tensor_parallel_config(config, dims.tp)
        if dims.ep > 1 and not config.moe_blocks:
            raise ValueError(
                f"strategy.ep={dims.ep} splits the experts of MoE blocks, and model={cfg.model.get('name', 'gpt')} "
                "has none: use model=gpt_moe_tiny (or set model.moe_experts), or set strategy.ep=1."
            )
        if dims.context > 1:  # two chunks of the sequence per cp rank; Ulysses gives each cp rank some of the heads
            check_sequence(config.seq_len, dims.cp, setting="strategy.cp")
            if strategy.config.cp_mode == "ulysses":
                check_heads(config.n_head, dims.cp, dims.tp, setting="strategy.cp_mode='ulysses'")
        if dims.ep > 1 and config.moe_experts % dims.ep:
            raise ValueError(
                f"strategy.ep={dims.ep} does not divide model.moe_experts={config.moe_experts}: choose ep among the "
                f"divisors of {config.moe_experts}."
            )
    if cfg.trainer.sync_batchnorm:
        raise ValueError("trainer.sync_batchnorm=true: the GPT has no BatchNorm to sync (LayerNorm needs none).")
    check_text_data(cfg)


def _check_library_model(cfg: DictConfig, meta: Any, num_layers: int, check_layout: Any) -> Any:
    """``model=hf*`` / ``model=litgpt``: the same checks, on the model built on the meta device;
    ``check_layout(meta, pp=, tp=, cp=, sequence_parallel=)`` the checks its module runs in the workers. Returns the
    strategy (checked, not yet used)."""
    strategy = check_run_settings(cfg, num_layers=num_layers)
    if dims := _dims(cfg, strategy):
        if dims.context > 1:  # what the workers' check_model would refuse, said before any of them starts
            check_sequence(cfg.model.seq_len, dims.cp, setting="strategy.cp")
            if strategy.config.cp_mode == "ulysses":
                heads = getattr(meta.config, "num_attention_heads", None) or meta.config.n_head  # HF's, LitGPT's
                check_heads(heads, dims.cp, dims.tp, setting="strategy.cp_mode='ulysses'")
        check_layout(meta, pp=dims.pp, tp=dims.tp, cp=dims.cp, sequence_parallel=strategy.config.sequence_parallel)
    if cfg.trainer.sync_batchnorm:
        raise ValueError("trainer.sync_batchnorm=true: the model has no BatchNorm to sync (its norms need none).")
    check_text_data(cfg)
    return strategy


def _degrees(cfg: DictConfig, strategy: Any) -> dict[str, int]:
    """The layout's pp, tp, cp and ep (1 under the strategies that split data only)."""
    dims = _dims(cfg, strategy)
    return {"pp": dims.pp, "tp": dims.tp, "cp": dims.cp, "ep": dims.ep} if dims else {"tp": 1}


def _sequence_parallel(strategy: Any) -> bool:
    return isinstance(strategy, Hybrid3DStrategy) and bool(strategy.config.sequence_parallel)


def _dims(cfg: DictConfig, strategy: Any) -> Any:
    """The hybrid3d layout's degrees (None under the other strategies: they split data only)."""
    return strategy.config.dims(world_size(cfg)) if isinstance(strategy, Hybrid3DStrategy) else None


def check_text_data(cfg: DictConfig) -> None:
    """The data file exists and holds a training and a validation window (read by its size only)."""
    d, seq = cfg.data, cfg.model.seq_len
    if d.kind in TOKENIZED_KINDS or (is_library_model(cfg.model) and cfg.model.path is not None):
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
        m = self.cfg.model
        vocab = litgpt_config(m).padded_vocab_size if is_litgpt_model(m) else model_vocab_size(m)
        if self.cfg.data.kind == "tokens" and int(tokens.max()) >= vocab:
            raise ValueError(
                f"data.path holds token id {int(tokens.max())} >= model.vocab_size={vocab}: "
                "set model.vocab_size to the tokenizer's vocabulary size."
            )
        seq, frac = self.cfg.model.seq_len, self.cfg.data.val_fraction
        # HF and LitGPT modules take labels unshifted (they shift them): (inputs, inputs), T - 1 targets a window
        hf = is_hf_model(self.cfg.model) or is_litgpt_model(self.cfg.model)
        self.train_set = TokenWindows(tokens, seq, "train", frac, labels_are_inputs=hf)
        self.val_set = TokenWindows(tokens, seq, "val", frac, labels_are_inputs=hf)

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
    the generator is seeded alike. Only byte ids are drawn; ``seq_len`` 0: the LitGPT's own."""
    seq_len = seq_len or model.config.seq_len
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    for _ in range(tokens):
        with whole_sequence(model):  # cp: the prompt is not split, every cp rank runs all of it
            out = model(idx[:, -seq_len:])
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
    if is_hf_model(m):
        model = build_hf_module(cfg)  # a folder's weights are read after the split; fresh ones seeded alike
        counts = parameter_counts(model)
    elif is_litgpt_model(m):
        model = build_litgpt_module(cfg)
        counts = parameter_counts(model)
    else:
        model = LitGPT(
            gpt_config(m),
            lr=m.lr,
            weight_decay=m.weight_decay,
            warmup_steps=m.warmup_steps,
            build_in_configure_model=True,
        )
        with torch.device("meta"):  # the model is built in configure_model: count the same one, allocating nothing
            counts = parameter_counts(GPT(gpt_config(m)))
    use_optimizer(model, cfg)  # optimizer=adamw|sgd|muon in place of the model's own
    trainer = build_trainer(cfg, run_dir)
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
