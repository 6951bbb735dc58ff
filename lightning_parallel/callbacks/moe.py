"""Mixture-of-Experts under any strategy: the auxiliary losses' gradient scale under Lightning's own strategies,
and per-layer expert load in the logs.

May import: Lightning and ``lightning_parallel.parallel``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.devices import collective_device
from lightning_parallel.parallel.expert.aux import set_aux_loss_scale
from lightning_parallel.parallel.expert.moe import moe_layers


def _precision_scale(trainer: pl.Trainer) -> float:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and hasattr(scaler, "get_scale") else 1.0


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
    ``summary()`` gives the run's figures (the recipes write them to metrics.json).

    The figures stay on the layers' device: they are reduced there (on the device the group's backend serves) and
    reach the host only when logged and in ``summary()``."""

    def __init__(self) -> None:
        self._run: dict[str, _RunTotals] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        layers = moe_layers(pl_module)
        if not layers:
            return
        group = _batch_group(trainer)
        ranks = dist.get_world_size(group) if group is not False else 1
        log = trainer.global_step % max(trainer.log_every_n_steps, 1) == 0
        for name, layer in layers.items():
            sums, forwards, choices = layer.totals()
            layer.reset_stats()
            if group is not False:
                sums = summed_over(sums, group)
            run = self._run.setdefault(name, _RunTotals.zeros(layer.num_experts, sums.device))
            figures = run.add(sums[: layer.num_experts], *_means(sums, layer.num_experts, forwards, choices, ranks))
            if log:  # the one host copy of this layer's figures, at logging steps only
                aux, tokens_max, tokens_min, imbalance = figures.tolist()
                short = name.replace(".", "/")
                pl_module.log(f"moe/{short}/aux_loss", aux, rank_zero_only=True)
                pl_module.log(f"moe/{short}/max_tokens", tokens_max, rank_zero_only=True)
                pl_module.log(f"moe/{short}/min_tokens", tokens_min, rank_zero_only=True)
                pl_module.log(f"moe/{short}/max_over_mean", imbalance, rank_zero_only=True)

    def summary(self, trainer: pl.Trainer | None = None) -> dict[str, dict[str, Any]]:
        """Per layer: tokens per expert over the run (summed over the data-parallel ranks), their min and max, the
        mean and worst per-batch ``max_over_mean``, the mean auxiliary loss and dropped fraction (averaged over the
        data-parallel ranks). With ``trainer`` under a process group every rank calls it: the layers other
        pipeline stages hold are gathered in."""
        mine = {name: run.to_host() for name, run in self._run.items()}
        if trainer is None or not (dist.is_available() and dist.is_initialized()):
            return mine
        everyone: list[dict] = [{}] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged: dict[str, dict[str, Any]] = {}
        for part in everyone:
            for name, stats in part.items():
                merged.setdefault(name, stats)
        return dict(sorted(merged.items()))


def summed_over(values: Tensor, group: Any) -> Tensor:
    """``values`` summed over ``group`` on the device its backend serves (where the statistics already are, CUDA
    under NCCL and the host under gloo: then no copy), returned on ``values``' device."""
    device = collective_device(group)
    out = values.to(device)
    dist.all_reduce(out, group=group)
    return out.to(values.device)


def _means(sums: Tensor, experts: int, forwards: int, choices: int, ranks: int) -> tuple[Tensor, Tensor]:
    """The batch's mean load-balancing loss and dropped fraction over the ranks' forwards (every rank runs as
    many forwards over as many choices), from sums summed over ``ranks``."""
    dropped, aux = sums[experts], sums[experts + 1]
    return aux / max(forwards * ranks, 1), dropped / max(choices * ranks, 1)


@dataclass
class _RunTotals:
    """One layer's figures over the run, on the device: summed tokens per expert, and the sums over batches of the
    mean aux loss, the dropped fraction and ``max_over_mean`` (and its worst)."""

    tokens: Tensor  # (E,) float64
    sums: Tensor  # (3,) float64: aux loss, dropped fraction, max_over_mean
    worst: Tensor  # () float64
    batches: int = 0

    @staticmethod
    def zeros(experts: int, device: torch.device) -> _RunTotals:
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        return _RunTotals(zeros(experts), zeros(3), zeros(()))

    def add(self, counts: Tensor, aux: Tensor, dropped: Tensor) -> Tensor:
        """One batch's counts (summed over the ranks); returns its aux loss, max, min and max_over_mean."""
        imbalance = counts.max() / counts.mean().clamp_min(1e-12)
        self.tokens += counts
        self.sums += torch.stack([aux, dropped, imbalance])
        torch.maximum(self.worst, imbalance, out=self.worst)
        self.batches += 1
        return torch.stack([aux, counts.max(), counts.min(), imbalance])

    def to_host(self) -> dict[str, Any]:
        tokens = [int(count) for count in self.tokens.tolist()]
        aux, dropped, imbalance = (value / max(self.batches, 1) for value in self.sums.tolist())
        return {
            "tokens_per_expert": tokens,
            "min_tokens": min(tokens),
            "max_tokens": max(tokens),
            "max_over_mean_per_batch": imbalance,
            "worst_max_over_mean": float(self.worst),
            "aux_loss": aux,
            "dropped_fraction": dropped,
        }


def _batch_group(trainer: pl.Trainer) -> Any:
    """The ranks that see different samples (the mesh's ``batch`` role; None: the world), False without a
    process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    mesh = getattr(trainer.strategy, "mesh", None)
    return mesh.group("batch") if mesh is not None else None
