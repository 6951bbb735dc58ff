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
from torch import Tensor, nn

from lightning_parallel.parallel.devices import collective_device
from lightning_parallel.parallel.expert.aux import set_aux_loss_scale
from lightning_parallel.parallel.expert.moe import MoE, moe_layers


def _precision_scale(trainer: pl.Trainer) -> float:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and hasattr(scaler, "get_scale") else 1.0


class MoEAuxLossScale(pl.Callback):
    """Under Lightning's own strategies ("auto", "ddp", "fsdp"): before each backward, give the MoE layers'
    auxiliary losses the factor the main loss carries (fp16 loss scale / accumulate_grad_batches), so training
    with gradient accumulation or fp16 adds exactly ``coeff * aux`` to the objective. The strategies of this
    package do it themselves; there this callback changes nothing. A rank that holds no MoE layer reads nothing
    (fp16's scale is a device tensor: reading it every backward would be a host sync)."""

    def __init__(self) -> None:
        self._active = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._active = bool(held_moe_layers(pl_module))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._active:
            set_aux_loss_scale(_precision_scale(trainer) / trainer.accumulate_grad_batches)


class MoEMonitor(pl.Callback):
    """Per MoE layer and training batch: the tokens each expert got over the data-parallel ranks (one small
    all-reduce per layer over the mesh's ``batch`` role, or the world under Lightning's own strategies), logged
    every ``log_every_n_steps`` as ``moe/<layer>/{aux_loss,min_tokens,max_tokens,max_over_mean}``. ``max_over_mean``
    (the busiest expert's load over the mean; 1 is perfect balance, E/k every token on the same k experts) is the
    figure to watch: a run's summed counts can look balanced while each step sends everything to a few experts.
    ``summary()`` gives the run's figures (the recipes write them to metrics.json).

    Under pp each stage reduces the layers it holds (over its ``batch`` ranks) and rank 0 logs every stage's: the
    figures of a logging step are gathered over the ``stage`` role's group. The figures stay on the layers' device:
    they are reduced there (on the device the group's backend serves) and reach the host only when logged and in
    ``summary()``."""

    def __init__(self) -> None:
        self._run: dict[str, _RunTotals] = {}
        self._stages: Any = None  # under pp: the group whose stages' figures rank 0 logs (None: this rank's only)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stages = _stage_group(trainer, len(held_moe_layers(pl_module)))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        layers = held_moe_layers(pl_module)
        if not layers and self._stages is None:
            return
        group = _batch_group(trainer)
        ranks = dist.get_world_size(group) if group is not False else 1
        figures = {}
        for name, layer in layers.items():
            sums, forwards, choices = layer.totals()
            layer.reset_stats()
            if group is not False:
                sums = summed_over(sums, group)
            run = self._run.setdefault(name, _RunTotals.zeros(layer.num_experts, sums.device))
            figures[name] = run.add(
                sums[: layer.num_experts], *_means(sums, layer.num_experts, forwards, choices, ranks)
            )
        if trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            for name, (aux, tokens_max, tokens_min, imbalance) in self._gathered(figures).items():
                short = name.replace(".", "/")
                pl_module.log(f"moe/{short}/aux_loss", aux, rank_zero_only=True)
                pl_module.log(f"moe/{short}/max_tokens", tokens_max, rank_zero_only=True)
                pl_module.log(f"moe/{short}/min_tokens", tokens_min, rank_zero_only=True)
                pl_module.log(f"moe/{short}/max_over_mean", imbalance, rank_zero_only=True)

    def _gathered(self, figures: dict[str, Tensor]) -> dict[str, list[float]]:
        """The batch's figures of this rank's layers on the host (one copy, at logging steps only); under pp those
        of every stage's layers, so that rank 0, the one that logs, logs all of them."""
        values = torch.stack(list(figures.values())).tolist() if figures else []
        mine = dict(zip(figures, values))
        if self._stages is None:
            return mine
        everyone: list[dict] = [{}] * dist.get_world_size(self._stages)
        dist.all_gather_object(everyone, mine, group=self._stages)
        return {name: value for part in everyone for name, value in part.items()}

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


def held_moe_layers(module: nn.Module) -> dict[str, MoE]:
    """The MoE layers under ``module`` this rank holds: those of other pipeline stages are placeholders, or still
    on the meta device where a model keeps them (they have no statistics here)."""
    return {name: layer for name, layer in moe_layers(module).items() if not layer.router.weight.is_meta}


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


def _stage_group(trainer: pl.Trainer, held: int) -> Any:
    """Under pp > 1 with MoE layers on any stage: the ``stage`` role's group (every pp rank gathers its layers'
    figures over it at logging steps, a stage without MoE layers too); else None. One small all-reduce of the held
    layers' count over that group, at the start of training."""
    mesh = getattr(trainer.strategy, "mesh", None) if dist.is_available() and dist.is_initialized() else None
    if mesh is None or mesh.size("stage") == 1:
        return None
    group = mesh.group("stage")
    count = torch.tensor([held], device=collective_device(group))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return group if int(count.item()) > 0 else None


def _batch_group(trainer: pl.Trainer) -> Any:
    """The ranks that see different samples (the mesh's ``batch`` role; None: the world), False without a
    process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    mesh = getattr(trainer.strategy, "mesh", None)
    return mesh.group("batch") if mesh is not None else None
