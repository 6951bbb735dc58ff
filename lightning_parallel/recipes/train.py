"""``train(cfg)``: what recipes/train_gpt.py runs in each worker process.

It builds the strategy, model, data, callbacks, loggers and Trainer from the composed config, trains, and
writes ``metrics.json`` (the fields listed in shared/DESIGN.md) into the run directory.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel import Hybrid3DStrategy, ZeroStrategy
from lightning_parallel.models import GPTConfig, LitGPT
from lightning_parallel.models.gpt import GPT
from lightning_parallel.parallel.partition import check_stage_count
from lightning_parallel.recipes.config import StrategyConf
from lightning_parallel.recipes.text_data import TokenWindows, load_tokens
from lightning_parallel.strategies.pipelined_step import PipelineInput

ZERO_NAMES = {"zero1": (1, False), "zero2": (2, False), "zero3": (3, False)}
ZERO_NAMES |= {"zero2_offload": (2, True), "zero3_offload": (3, True)}


def build_strategy(conf: DictConfig) -> Any:
    """The strategy object (or Lightning's name) for ``strategy=...``; settings it cannot use are refused."""
    name = conf.name
    if name == "hybrid3d":
        return Hybrid3DStrategy(
            dp=conf.dp,
            pp=conf.pp,
            tp=conf.tp,
            zero_stage=conf.zero_stage,
            pp_schedule=conf.pp_schedule,
            microbatches=conf.microbatches,
            pp_balance=conf.pp_balance,
            pp_virtual_stages=conf.pp_virtual_stages,
            sequence_parallel=conf.sequence_parallel,
            offload=conf.offload,
        )
    defaults = StrategyConf()
    hybrid_only = ["dp", "pp", "tp", "pp_schedule", "microbatches", "pp_balance", "pp_virtual_stages"]
    changed = [k for k in [*hybrid_only, "sequence_parallel"] if conf[k] != getattr(defaults, k)]
    if changed:
        set_ = ", ".join(f"strategy.{k}={conf[k]}" for k in changed)
        raise ValueError(f"{set_} needs strategy=hybrid3d: strategy={name} only splits data, so it would ignore it.")
    if name in ZERO_NAMES:
        stage, offload = ZERO_NAMES[name]
        if conf.zero_stage not in (0, stage) or (conf.offload and not offload):
            raise ValueError(
                f"strategy={name} is ZeRO stage {stage}: pick strategy=zero{conf.zero_stage} instead of setting "
                "strategy.zero_stage, or use strategy=hybrid3d with strategy.zero_stage."
            )
        return ZeroStrategy(stage=stage, offload=offload)
    if name == "ddp":
        if conf.offload:
            raise ValueError("strategy=ddp keeps no state on the host (strategy.offload=true): use zero2_offload.")
        if conf.zero_stage:
            raise ValueError(
                f"strategy=ddp does not shard (strategy.zero_stage={conf.zero_stage}): use strategy=zero1..3."
            )
        return "ddp"
    raise ValueError(
        f"strategy={name!r} is unknown: use ddp, {', '.join(ZERO_NAMES)} or hybrid3d (conf/strategy/ lists presets)."
    )


def data_parallel_size(conf: DictConfig, world: int) -> int:
    """How many different batches one optimizer step sees: the world size minus what pp and tp take."""
    if conf.name != "hybrid3d":
        return world
    if conf.dp != "auto":
        return int(conf.dp)
    return max(1, world // (conf.pp * conf.tp))


def micro_batch_size(cfg: DictConfig, world: int) -> int:
    """Samples per dp rank per forward so that one optimizer step sees ``data.global_batch_size``."""
    dp = data_parallel_size(cfg.strategy, world)
    accumulate = cfg.trainer.accumulate_grad_batches
    size, rest = divmod(cfg.data.global_batch_size, dp * accumulate)
    if rest or size == 0:
        raise ValueError(
            f"data.global_batch_size={cfg.data.global_batch_size} does not split over dp={dp} x "
            f"trainer.accumulate_grad_batches={accumulate}: make it a multiple of {dp * accumulate}."
        )
    return size


def gpt_config(m: DictConfig) -> GPTConfig:
    return GPTConfig(
        vocab_size=m.vocab_size,
        seq_len=m.seq_len,
        n_layer=m.n_layer,
        n_head=m.n_head,
        d_model=m.d_model,
        mlp_ratio=m.mlp_ratio,
        dropout=m.dropout,
    )


def check_config(cfg: DictConfig) -> None:
    """Everything that can be refused before a worker starts: names, degrees, sizes, batch splits."""
    devices = cfg.trainer.devices
    strategy = build_strategy(cfg.strategy)
    config = gpt_config(cfg.model)
    if isinstance(strategy, Hybrid3DStrategy):
        dims = strategy._parallel_degrees(devices)
        GPT.check_tensor_parallel_config(config, dims.tp)
        check_stage_count(config.n_layer + 2, dims.pp * strategy.pp_virtual_stages, f"strategy.pp={dims.pp}")
    elif devices < 2 and strategy != "ddp":
        raise ValueError(f"strategy={cfg.strategy.name} shards over processes: set trainer.devices to 2 or more.")
    micro_batch_size(cfg, devices)
    if cfg.checkpoint.dir and cfg.checkpoint.every_n_steps <= 0:
        raise ValueError(
            f"checkpoint.dir={cfg.checkpoint.dir!r} with checkpoint.every_n_steps={cfg.checkpoint.every_n_steps} "
            "would save nothing: set checkpoint.every_n_steps to a positive step count."
        )


class TextData(pl.LightningDataModule):
    """Train and validation windows of the corpus; each dp rank reads its share of every global batch."""

    def __init__(self, cfg: DictConfig, micro_batch: int, cache_dir: Path) -> None:
        super().__init__()
        self.cfg, self.micro_batch, self.cache_dir = cfg, micro_batch, cache_dir

    def setup(self, stage: str) -> None:
        tokens = load_tokens(self.cfg.data.kind, self.cfg.data.path, self.cache_dir)
        if self.cfg.data.kind == "tokens" and int(tokens.max()) >= self.cfg.model.vocab_size:
            raise ValueError(
                f"data.path holds token id {int(tokens.max())} >= model.vocab_size={self.cfg.model.vocab_size}: "
                "set model.vocab_size to the tokenizer's vocabulary size."
            )
        seq, frac = self.cfg.model.seq_len, self.cfg.data.val_fraction
        self.train_set = TokenWindows(tokens, seq, "train", frac)
        self.val_set = TokenWindows(tokens, seq, "val", frac)

    def _loader(self, dataset: TokenWindows, shuffle: bool) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=self.cfg.seed, drop_last=True, **kwargs)
        return DataLoader(
            dataset, batch_size=self.micro_batch, sampler=sampler, num_workers=self.cfg.data.num_workers, drop_last=True
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


def _logger(cfg: DictConfig, run_dir: Path) -> Any:
    kind = cfg.trainer.logger
    if kind == "csv":
        return CSVLogger(run_dir, name="logs")
    if kind == "tensorboard":
        return TensorBoardLogger(run_dir, name="tb")
    if kind == "none":
        return False
    raise ValueError(f"trainer.logger={kind!r} is unknown: use csv, tensorboard or none.")


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # peak resident memory of this process


def _all_ranks(value: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


@torch.no_grad()
def generate(model: LitGPT, prompt: bytes, tokens: int) -> bytes:
    """Greedy continuation of ``prompt``, runnable under every layout (collective under pp and tp)."""
    seq_len = model.config.seq_len
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    model.eval()
    for _ in range(tokens):
        out = model(idx[:, -seq_len:])
        logits = out.materialize() if isinstance(out, PipelineInput) else out
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True).to(idx.device)], dim=1)
    return bytes(idx[0].tolist())


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the metrics written to ``run_dir/metrics.json`` (by rank 0)."""
    pl.seed_everything(cfg.seed, verbose=False)
    devices = cfg.trainer.devices
    strategy = build_strategy(cfg.strategy)
    micro = micro_batch_size(cfg, devices)
    m = cfg.model
    config = gpt_config(m)
    model = LitGPT(
        config, lr=m.lr, weight_decay=m.weight_decay, warmup_steps=m.warmup_steps, build_in_configure_model=True
    )
    callbacks: list[pl.Callback] = []
    if cfg.checkpoint.dir and cfg.checkpoint.every_n_steps > 0:
        callbacks.append(
            ModelCheckpoint(
                dirpath=cfg.checkpoint.dir, every_n_train_steps=cfg.checkpoint.every_n_steps, save_last=True
            )
        )
    t = cfg.trainer
    trainer = pl.Trainer(
        accelerator=t.accelerator,
        devices=devices,
        strategy=strategy,
        precision=cfg.precision.value,
        max_steps=t.max_steps,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=min(t.val_check_interval, t.max_steps),
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        gradient_clip_val=t.gradient_clip_val,
        accumulate_grad_batches=t.accumulate_grad_batches,
        enable_progress_bar=t.enable_progress_bar,
        enable_checkpointing=bool(callbacks),
        logger=_logger(cfg, run_dir),
        callbacks=callbacks,
        use_distributed_sampler=False,  # TextData splits each global batch over the dp axis itself
        num_sanity_val_steps=0,
    )
    data = TextData(cfg, micro, cache_dir=Path.cwd() / "data")  # the default corpus is written there once
    start = time.perf_counter()
    trainer.fit(model, datamodule=data, ckpt_path=cfg.ckpt_path)
    wall = time.perf_counter() - start
    logged = trainer.callback_metrics
    steps = trainer.global_step
    dims = getattr(trainer.strategy, "parallel_dims", None)
    layout = {
        "dp": dims.dp if dims else trainer.world_size,
        "pp": dims.pp if dims else 1,
        "tp": dims.tp if dims else 1,
        "zero_stage": getattr(trainer.strategy, "zero_stage", 0),
        "precision": cfg.precision.value,
        "world_size": trainer.world_size,  # as the workers saw it
    }
    metrics = {
        "final_train_loss": float(logged["train_loss"]) if "train_loss" in logged else None,
        "final_val_loss": float(logged["val_loss"]) if "val_loss" in logged else None,
        "throughput": steps * cfg.data.global_batch_size * m.seq_len / wall,  # tokens per second
        "throughput_unit": "tokens/s",
        "peak_memory_bytes": _all_ranks(_peak_memory_bytes(trainer.strategy.root_device)),
        "layout": layout,
        "steps": steps,
        "wall_seconds": wall,
    }
    if cfg.sample_tokens > 0:
        metrics["sample"] = generate(model, b"The ", cfg.sample_tokens).decode("utf-8", errors="replace")
    if trainer.global_rank == 0:
        (Path(run_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2))
        if "sample" in metrics:
            print(f"\n--- sample ---\n{metrics['sample']}\n--------------")
    return metrics
