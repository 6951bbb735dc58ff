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
    """Logs, per MoE layer and every ``log_every_n_steps``: the auxiliary (load-balancing) loss, the fewest and
    most tokens any expert got, and the fraction of choices dropped for capacity, summed over the data-parallel
    ranks' tokens. ``summary()`` gives the same over the whole run (the recipes write it to metrics.json)."""

    def __init__(self) -> None:
        self._run: dict[str, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        layers = moe_layers(pl_module)
        if not layers:
            return
        for name, layer in layers.items():
            stats = layer.stats()
            layer.reset_stats()
            run = self._run.setdefault(name, {"tokens": [0] * layer.num_experts, "aux": [], "dropped": []})
            run["tokens"] = [a + b for a, b in zip(run["tokens"], stats["tokens_per_expert"])]
            run["aux"].append(stats["aux_loss"])
            run["dropped"].append(stats["dropped_fraction"])
            if trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
                short = name.replace(".", "/")
                pl_module.log(f"moe/{short}/aux_loss", stats["aux_loss"], rank_zero_only=True)
                pl_module.log(f"moe/{short}/max_tokens", float(max(stats["tokens_per_expert"])), rank_zero_only=True)
                pl_module.log(f"moe/{short}/min_tokens", float(min(stats["tokens_per_expert"])), rank_zero_only=True)

    def summary(self, trainer: pl.Trainer | None = None) -> dict[str, dict[str, Any]]:
        """Per layer: tokens per expert over the run, their min and max, the mean auxiliary loss and dropped
        fraction. With ``trainer`` under a process group (every rank calls): token counts summed over the ranks
        that saw different samples (the mesh's ``batch`` role under this package's strategies, else the world),
        and the layers other pipeline stages hold gathered in."""
        distributed = trainer is not None and dist.is_available() and dist.is_initialized()
        if distributed:
            mesh = getattr(trainer.strategy, "mesh", None)
            group = mesh.group("batch") if mesh is not None else None
        mine = {}
        for name, run in self._run.items():
            tokens = torch.tensor(run["tokens"], dtype=torch.long)
            means = torch.tensor([_mean(run["aux"]), _mean(run["dropped"])], dtype=torch.float64)
            if distributed:
                dist.all_reduce(tokens, group=group)
                dist.all_reduce(means, group=group)
                means /= dist.get_world_size(group)  # each rank's mean over equally many samples
            mine[name] = {
                "tokens_per_expert": tokens.tolist(),
                "min_tokens": int(tokens.min()),
                "max_tokens": int(tokens.max()),
                "aux_loss": float(means[0]),
                "dropped_fraction": float(means[1]),
            }
        if not distributed:
            return mine
        everyone: list[dict] = [{}] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged: dict[str, dict[str, Any]] = {}
        for part in everyone:
            for name, stats in part.items():
                merged.setdefault(name, stats)
        return dict(sorted(merged.items()))
