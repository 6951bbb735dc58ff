"""The recipes' ``metrics.json``: what the workers measured (losses, the steady and whole-fit rates, memory, the
layout, MoE and async_ps figures), gathered from every rank and written by rank 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_parallel.callbacks.activation import ActivationMemoryMonitor
from lightning_parallel.callbacks.moe import MoEMonitor
from lightning_parallel.callbacks.monitor import TrainingMonitor
from lightning_parallel.parallel.measure.flops import peak_memory_bytes
from lightning_parallel.parallel.mesh import PLAIN_AXES
from lightning_parallel.strategies.async_ps import AsyncPSStrategy


def all_ranks(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (collective; this rank's alone after an async_ps run, whose workers
    end at their own pace and may have died)."""
    if not (dist.is_available() and dist.is_initialized()) or _ASYNC_PS_RUN.get("active"):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_metrics(trainer: pl.Trainer, cfg: DictConfig, wall: float, items_per_step: int, unit: str) -> dict[str, Any]:
    """The metrics.json fields docs/recipes.md lists, from what the workers saw (collective)."""
    logged = trainer.callback_metrics
    steps = trainer.global_step
    _ASYNC_PS_RUN["active"] = isinstance(trainer.strategy, AsyncPSStrategy)
    dims = getattr(trainer.strategy, "parallel_dims", None)
    data_parallel = trainer.world_size if dims is None else dims.dp
    if _ASYNC_PS_RUN["active"]:  # the servers hold no batch: the workers are the data-parallel ranks
        data_parallel = trainer.strategy.num_workers
    layout = {
        "dp": data_parallel,
        "pp": dims.pp if dims else 1,
        "tp": dims.tp if dims else 1,
        "ep": dims.ep if dims else 1,
        "cp": dims.context if dims else 1,  # context parallelism: each sequence split over cp ranks
        "cp_mode": trainer.strategy.config.cp_mode if dims and dims.context > 1 else None,  # ring or ulysses
        "spatial": dims.spatial if dims else 1,  # spatial parallelism: each image split into strips (the cp axis)
        "dp_shard": dims.dp_shard if dims else data_parallel,  # HSDP: dp / dp_shard replicas of the states
        "num_nodes": trainer.num_nodes,
        "zero_stage": config.zero_stage if (config := getattr(trainer.strategy, "config", None)) else 0,
        # under pp: the pipeline schedule and microbatches per step (as validated: the default 2 * pp filled in)
        "pp_schedule": config.pp_schedule if dims and dims.pp > 1 else None,
        "microbatches": config.microbatches if dims and dims.pp > 1 else None,
        "precision": cfg.precision.value,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,  # as the workers saw it
    }
    if dims:  # an axis whose size is its setting, added since: under its own name
        layout |= {axis: dims.degrees[axis] for axis in PLAIN_AXES if axis not in layout}
    if _ASYNC_PS_RUN["active"]:
        layout |= {"workers": data_parallel, "servers": trainer.strategy.num_servers}
    return {
        "final_train_loss": _final_train_loss(trainer),
        "final_val_loss": float(logged["val_loss"]) if "val_loss" in logged else None,
        **_monitor_metrics(trainer, cfg, wall, items_per_step, unit),
        "throughput_unit": unit,
        # setup, sanity checks, validation and every step: what a short run mostly spends setting up
        "throughput_whole_fit": steps * items_per_step / wall,
        "peak_memory_bytes": all_ranks(peak_memory_bytes(trainer.strategy.root_device)),
        # bytes of activations held for backward in one training batch (see ActivationMemoryMonitor), per rank
        "activation_memory_bytes": all_ranks(_activation_bytes(trainer)),
        "activation_checkpointing": cfg.strategy.get("activation_checkpointing", "none"),
        "layout": layout,
        # strategy=auto: the chosen layout's predicted figures (memory per rank, step time; recipes/auto.py)
        "planned": OmegaConf.to_container(cfg.strategy.planned) if cfg.strategy.get("planned") else None,
        # per MoE layer: tokens per expert over the run (summed over the data-parallel ranks), their min and max,
        # the mean load-balancing loss and dropped fraction; {} for a dense model
        "moe": _moe_metrics(trainer),
        "steps": steps,
        "wall_seconds": wall,
        **_async_ps_metrics(trainer, cfg, wall),
    }


_ASYNC_PS_RUN: dict[str, bool] = {}


def _final_train_loss(trainer: pl.Trainer) -> float | None:
    """The last logged ``train_loss`` (``sync_dist``: the global one); under async_ps, whose workers log their own
    share's, server 0's mean of the workers' last pushes (at staleness 0 the global batch's loss)."""
    strategy = trainer.strategy
    counters = strategy.counters if isinstance(strategy, AsyncPSStrategy) else None
    if counters and counters[0].get("train_loss") is not None:
        return float(counters[0]["train_loss"])
    logged = trainer.callback_metrics
    return float(logged["train_loss"]) if "train_loss" in logged else None


def _async_ps_metrics(trainer: pl.Trainer, cfg: DictConfig, wall: float) -> dict[str, Any]:
    """Under async_ps: rank 0's view of the servers' counters. One *update* is one optimizer step on the servers:
    at staleness 0 the mean of every worker's push of a step (a global batch), above 0 one push (one worker's
    share of a global batch). ``steps`` is then rank 0's own step count."""
    strategy = trainer.strategy
    if not isinstance(strategy, AsyncPSStrategy) or not strategy.counters:
        return {}
    server = strategy.counters[0]
    workers = strategy.num_workers
    per_update = cfg.data.global_batch_size // (1 if strategy.staleness == 0 else workers)
    return {
        "async_ps": {
            "num_servers": strategy.num_servers,
            "staleness": strategy.staleness,
            "workers": workers,
            "updates": server["updates"],
            "samples_per_update": per_update,
            "updates_per_second": server["updates"] / wall,  # over the whole fit, start-up included
            "servers": strategy.counters,
        }
    }


def _monitor_metrics(trainer: pl.Trainer, cfg: DictConfig, wall: float, items_per_step: int, unit: str) -> dict:
    """TrainingMonitor's measurements (collective): the steady rates over the uninstrumented steps after the first,
    validation left out (the whole fit's when there were too few steps), MFU (None off the GPUs it knows), and per
    rank: model-state bytes and the bytes each op kind moved in the measured step (conventions:
    parallel/measure/comm_volume.py)."""
    monitor = next((c for c in trainer.callbacks if isinstance(c, TrainingMonitor)), None)
    summary = monitor.summary if monitor is not None else {}
    steady = monitor.steady_rates() if monitor is not None else {}
    batch = cfg.data.global_batch_size
    samples_per_second = steady.get("samples_per_second") or trainer.global_step * batch / wall
    out: dict[str, Any] = {"samples_per_second": samples_per_second}
    # the steady-state rate, in the recipe's unit (items_per_step: the tokens or the samples of a step)
    out["throughput"] = samples_per_second * items_per_step / batch
    if unit == "tokens/s":
        out["tokens_per_second"] = steady.get("tokens_per_second") or out["throughput"]
    out["mfu"] = summary.get("mfu")
    out["flops_per_step"] = summary.get("flops_per_step")
    out["model_state_bytes"] = all_ranks(summary.get("model_state_bytes"))
    out["comm_bytes_per_step"] = all_ranks(summary.get("comm_bytes_per_step"))
    out["comm_bytes_by_axis"] = all_ranks(summary.get("comm_bytes_by_axis"))  # per rank: {axes: bytes}
    if "pipeline_bubble" in summary:  # rank 0's: the idle fraction of each pp rank, from the timeline
        out["pipeline_bubble"] = summary["pipeline_bubble"]
    return out


def _moe_metrics(trainer: pl.Trainer) -> dict[str, Any]:
    monitor = next((c for c in trainer.callbacks if isinstance(c, MoEMonitor)), None)
    return monitor.summary(trainer) if monitor is not None else {}


def _activation_bytes(trainer: pl.Trainer) -> int | None:
    monitor = next((c for c in trainer.callbacks if isinstance(c, ActivationMemoryMonitor)), None)
    return monitor.bytes if monitor is not None else None


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """metrics.json's ``trainable_params`` and ``frozen_params`` of the whole model (a tied weight once; meta
    tensors counted by their shapes), before any strategy splits it."""
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return {"trainable_params": trainable, "frozen_params": sum(p.numel() for p in params) - trainable}


def write_metrics(trainer: pl.Trainer, metrics: dict[str, Any], run_dir: Path) -> None:
    if trainer.global_rank == 0:
        (Path(run_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2))
