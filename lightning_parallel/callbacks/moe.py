"""Mixture-of-Experts under any strategy: the auxiliary losses' gradient scale under Lightning's own strategies,
and per-layer expert load in the logs.

May import: Lightning and ``lightning_parallel.parallel``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.expert.aux import set_aux_loss_scale
from lightning_parallel.parallel.expert.moe import moe_layers


def _precision_scale(trainer: pl.Trainer) -> float:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and hasattr(scaler, "get_scale") else 1.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class MoEAuxLossScale(pl.Callback):
    """Under Lightning's own strategies ("auto", "ddp", "fsdp"): before each backward, give the MoE layers'
    auxiliary losses the factor the main loss carries (fp16 loss scale / accumulate_grad_batches), so training
    with gradient accumulation or fp16 adds exactly ``coeff * aux`` to the objective. The strategies of this
    package do it themselves; there this callback changes nothing."""

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        set_aux_loss_scale(_precision_scale(trainer) / trainer.accumulate_grad_batches)


class MoEMonitor(pl.Callback):
    """Per MoE layer and training batch: the tokens each expert got over the data-parallel ranks (one small
    all-reduce per layer over the mesh's ``batch`` role, or the world under Lightning's own strategies), logged
    every ``log_every_n_steps`` as ``moe/<layer>/{aux_loss,min_tokens,max_tokens,max_over_mean}``. ``max_over_mean``
    (the busiest expert's load over the mean; 1 is perfect balance, E/k every token on the same k experts) is the
    figure to watch: a run's summed counts can look balanced while each step sends everything to a few experts.
    ``summary()`` gives the run's figures (the recipes write them to metrics.json)."""

    def __init__(self) -> None:
        self._run: dict[str, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        layers = moe_layers(pl_module)
        if not layers:
            return
        group = _batch_group(trainer)
        for name, layer in layers.items():
            stats = layer.stats()
            layer.reset_stats()
            counts = torch.tensor(stats["tokens_per_expert"], dtype=torch.long)
            if group is not False:
                dist.all_reduce(counts, group=group)
            run = self._run.setdefault(
                name, {"tokens": [0] * layer.num_experts, "aux": [], "dropped": [], "imbalance": []}
            )
            run["tokens"] = [a + b for a, b in zip(run["tokens"], counts.tolist())]
            run["aux"].append(stats["aux_loss"])
            run["dropped"].append(stats["dropped_fraction"])
            imbalance = float(counts.max()) / max(float(counts.float().mean()), 1e-12)
            run["imbalance"].append(imbalance)
            if trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
                short = name.replace(".", "/")
                pl_module.log(f"moe/{short}/aux_loss", stats["aux_loss"], rank_zero_only=True)
                pl_module.log(f"moe/{short}/max_tokens", float(counts.max()), rank_zero_only=True)
                pl_module.log(f"moe/{short}/min_tokens", float(counts.min()), rank_zero_only=True)
                pl_module.log(f"moe/{short}/max_over_mean", imbalance, rank_zero_only=True)

    def summary(self, trainer: pl.Trainer | None = None) -> dict[str, dict[str, Any]]:
        """Per layer: tokens per expert over the run (summed over the data-parallel ranks), their min and max, the
        mean and worst per-batch ``max_over_mean``, the mean auxiliary loss and dropped fraction (averaged over the
        data-parallel ranks). With ``trainer`` under a process group every rank calls it: the layers other
        pipeline stages hold are gathered in."""
        group = _batch_group(trainer) if trainer is not None else False
        mine = {}
        for name, run in self._run.items():
            tokens = torch.tensor(run["tokens"], dtype=torch.long)
            means = torch.tensor([_mean(run["aux"]), _mean(run["dropped"])], dtype=torch.float64)
            if group is not False:
                dist.all_reduce(means, group=group)
                means /= dist.get_world_size(group)  # each rank's mean over equally many samples
            mine[name] = {
                "tokens_per_expert": tokens.tolist(),
                "min_tokens": int(tokens.min()),
                "max_tokens": int(tokens.max()),
                "max_over_mean_per_batch": _mean(run["imbalance"]),
                "worst_max_over_mean": max(run["imbalance"], default=0.0),
                "aux_loss": float(means[0]),
                "dropped_fraction": float(means[1]),
            }
        if group is False:
            return mine
        everyone: list[dict] = [{}] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged: dict[str, dict[str, Any]] = {}
        for part in everyone:
            for name, stats in part.items():
                merged.setdefault(name, stats)
        return dict(sorted(merged.items()))


def _batch_group(trainer: pl.Trainer) -> Any:
    """The ranks that see different samples (the mesh's ``batch`` role; None: the world), False without a
    process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    mesh = getattr(trainer.strategy, "mesh", None)
    return mesh.group("batch") if mesh is not None else None
