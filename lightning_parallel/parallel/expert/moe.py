"""A Mixture-of-Experts layer in pure torch: a drop-in replacement for a transformer FFN (Shazeer et al. 2017,
GShard, Switch Transformer, Mixtral).

- Router: a linear gate computed in fp32 also under autocast (Switch's selective precision: a bf16 router flips
  near-tied choices between layouts), softmax, top-k (k >= 1; the k weights renormalized to sum to 1 when k > 1).
- Experts: stacked weights (E x d x f, E x f x d) computed as one batched matmul over the experts, each expert's
  tokens padded to the largest count (no Python loop over experts); ``gelu`` or ``swiglu``; optional shared
  expert (an FFN every token goes through, DeepSeek-MoE).
- Dropless by default. With ``capacity_factor`` each *sample* (one sequence) gives each expert at most
  ``ceil(capacity_factor * T * k / E)`` of its T tokens' k choices; first choices before second choices, earlier
  positions first within a choice. A sample's drops depend on that sample only, so they are the same on any
  layout (data-parallel ranks, microbatches and expert-parallel ranks only move whole samples).
- Auxiliary losses, also per sample and then averaged over the samples of the forward (DeepSeek-V3's
  sequence-wise balance loss): the load-balancing loss of Switch/GShard ``E * sum_e f_e * P_e`` (f_e the fraction
  of the sample's k*T choices routed to expert e, P_e its mean router probability) and, optionally, the router
  z-loss ``mean(logsumexp(logits)^2)`` (ST-MoE). A mean over samples is what the main loss is too, so splitting
  a batch anywhere leaves their sum unchanged. They reach the gradients through :mod:`.aux`, not the returned loss.
- Expert parallelism: :func:`~lightning_parallel.parallel.expert.apply.apply_expert_parallel` leaves E/ep experts
  on each rank (the stacked weights become DTensors sharded on dim 0) and gives the layer the ep group; tokens
  then travel by all-to-all (:mod:`.dispatch`).

``stats()`` gives tokens per expert, the dropped fraction and the auxiliary losses of the training forwards (with
gradients) since the last ``reset_stats()``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel._compat import in_backward
from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.expert.aux import AttachAuxLoss
from lightning_parallel.parallel.expert.dispatch import exchange, sort_by_expert

ACTIVATIONS = ("gelu", "swiglu")


def check_moe_settings(num_experts: object, top_k: object, capacity_factor: object, activation: object) -> None:
    """Refuse settings the layer cannot run, naming the setting and the fix."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r}: set it to a positive integer.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be between 1 and num_experts={num_experts}: choose k <= the experts.")
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0
    ):
        raise ValueError(
            f"capacity_factor={capacity_factor!r} must be a positive number (1.25 is common) or None (dropless)."
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is unknown: use one of {', '.join(ACTIVATIONS)}.")


class GroupedExperts(nn.Module):
    """E FFNs as stacked weights ``w1`` (E, d, f), ``w2`` (E, f, d) (and ``w3`` (E, d, f) for SwiGLU).

    Under expert parallelism the weights are DTensors sharded on dim 0 and this rank computes its E/ep experts.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, activation: str = "gelu") -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden, self.activation = num_experts, dim, hidden, activation
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden)) if activation == "swiglu" else None
        if not self.w1.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(
        self, generator: torch.Generator | None = None, std: float = 0.02, out_std: float | None = None
    ) -> None:
        """N(0, std) inputs, N(0, out_std) outputs (GPT-2's scaled residual init), drawn on the host."""
        for name, weight in (("w1", self.w1), ("w3", self.w3), ("w2", self.w2)):
            if weight is None:
                continue
            sigma = (out_std if out_std is not None else std) if name == "w2" else std
            values = torch.randn(weight.shape, generator=generator) * sigma
            local(weight).copy_(_local_rows(values, weight))

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        """``rows`` grouped by this rank's experts (``counts`` per expert, in order) through their FFNs. Called as
        a module (ZeRO-3 gathers the weights in its forward hooks)."""
        w1, w2 = local(self.w1), local(self.w2)
        experts = w1.shape[0]
        which = torch.repeat_interleave(torch.arange(experts, device=rows.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(rows.shape[0], device=rows.device) - starts[which]
        width = int(counts.max().item()) if counts.numel() else 0  # 0 rows: the weights still get (zero) gradients
        padded = rows.new_zeros(experts, width, rows.shape[-1]).index_put((which, slot), rows)
        h = torch.bmm(padded, w1.to(rows.dtype))
        if self.w3 is not None:
            h = F.silu(h) * torch.bmm(padded, local(self.w3).to(rows.dtype))
        else:
            h = F.gelu(h)
        out = torch.bmm(h, w2.to(rows.dtype))
        return out[which, slot]


def _local_rows(full: Tensor, param: Tensor) -> Tensor:
    """The rows of ``full`` (E, ...) this rank holds of ``param`` (all of them unless expert-parallel)."""
    shard = local(param)
    if shard.shape[0] == full.shape[0]:
        return full
    assert isinstance(param, DTensor)
    index = param.device_mesh.get_local_rank()
    return full[index * shard.shape[0] : (index + 1) * shard.shape[0]]


class MoE(nn.Module):
    """Mixture-of-Experts FFN: ``(..., d) -> (..., d)``; inputs of 3 or more dims are samples of T tokens each.

    Args:
        dim: model width d.
        hidden: each expert's hidden width f.
        num_experts: E.
        top_k: experts per token.
        activation: ``gelu`` or ``swiglu``.
        capacity_factor: None (dropless) or the per-sample capacity factor (see the module docstring).
        shared_hidden: hidden width of a shared expert every token goes through (0: none).
        aux_loss_coeff: weight of the load-balancing loss in the gradient (0 turns it off).
        z_loss_coeff: weight of the router z-loss (0: off).
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int = 2,
        *,
        activation: str = "gelu",
        capacity_factor: float | None = None,
        shared_hidden: int = 0,
        aux_loss_coeff: float = 0.01,
        z_loss_coeff: float = 0.0,
    ) -> None:
        super().__init__()
        check_moe_settings(num_experts, top_k, capacity_factor, activation)
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden, activation)
        self.shared: nn.Module | None = None
        if shared_hidden:
            self.shared = nn.Sequential(nn.Linear(dim, shared_hidden), nn.GELU(), nn.Linear(shared_hidden, dim))
        self.ep_group: dist.ProcessGroup | None = None  # set by apply_expert_parallel
        self.reset_stats()

    # ----- statistics -----

    def reset_stats(self) -> None:
        self._tokens = torch.zeros(self.num_experts, dtype=torch.long)
        self._dropped = 0
        self._choices = 0
        self._aux: list[float] = []
        self._z: list[float] = []
        self._last_record: tuple[Tensor, int, int] | None = None

    def stats(self) -> dict[str, Any]:
        """Since the last reset: tokens routed to each expert (kept choices, this rank's tokens), the fraction of
        choices dropped for capacity, and the mean load-balancing and z-losses."""
        return {
            "tokens_per_expert": self._tokens.tolist(),
            "dropped_fraction": self._dropped / self._choices if self._choices else 0.0,
            "aux_loss": _mean(self._aux),
            "z_loss": _mean(self._z),
        }

    # ----- forward -----

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        per_sample = shape[-2] if x.dim() >= 3 else 1
        samples = tokens.shape[0] // per_sample
        with torch.autocast(tokens.device.type, enabled=False):  # the router in fp32 (Switch's selective precision)
            logits = F.linear(tokens.float(), self.router.weight.float())
        probs = logits.softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        weights = top_p / top_p.sum(-1, keepdim=True) if self.top_k > 1 else top_p
        keep = self._capacity_keep(top_i, samples, per_sample)
        routed = sort_by_expert(top_i, weights, keep)
        counts = torch.bincount(routed.expert, minlength=self.num_experts)
        rows = tokens[routed.token]
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            out_rows = exchange(rows, counts, self.ep_group, self.experts)
        else:
            out_rows = self.experts(rows, counts)
        mixed = out_rows * routed.weight.unsqueeze(-1).to(out_rows.dtype)
        out = torch.zeros_like(tokens, dtype=mixed.dtype).index_add(0, routed.token, mixed).to(tokens.dtype)
        if self.shared is not None:
            out = out + self.shared(tokens)
        aux = self._aux_loss(logits, probs, top_i, samples, per_sample)
        if aux is not None and torch.is_grad_enabled():
            out = AttachAuxLoss.apply(out, aux)
        if torch.is_grad_enabled() and not in_backward():
            # training forwards only: not evaluation, a pipeline's shape inference, or a checkpointed layer's recompute
            self._record(counts, keep, aux)
        return out.view(shape)

    def _capacity_keep(self, top_i: Tensor, samples: int, per_sample: int) -> Tensor:
        if self.capacity_factor is None:
            return torch.ones_like(top_i, dtype=torch.bool)
        k, experts = self.top_k, self.num_experts
        capacity = math.ceil(self.capacity_factor * per_sample * k / experts)
        # per sample, in priority order: every token's first choice, then every second choice, ...
        order = top_i.view(samples, per_sample, k).transpose(1, 2).reshape(samples, k * per_sample)
        onehot = F.one_hot(order, experts)
        position = (onehot.cumsum(1) - 1).gather(2, order.unsqueeze(-1)).squeeze(-1)
        keep = position < capacity
        return keep.view(samples, k, per_sample).transpose(1, 2).reshape(-1, k)

    def _aux_loss(self, logits: Tensor, probs: Tensor, top_i: Tensor, samples: int, per_sample: int) -> Tensor | None:
        self._last_aux = self._last_z = None
        total = None
        if self.aux_loss_coeff:
            experts, k = self.num_experts, self.top_k
            chosen = F.one_hot(top_i.view(samples, per_sample * k), experts).sum(1).to(probs.dtype)
            fraction = chosen / (per_sample * k)
            mean_prob = probs.view(samples, per_sample, experts).mean(1)
            balance = (experts * (fraction * mean_prob).sum(-1)).mean()
            self._last_aux = balance.detach()
            total = self.aux_loss_coeff * balance
        if self.z_loss_coeff:
            z = torch.logsumexp(logits, -1).pow(2).mean()
            self._last_z = z.detach()
            total = self.z_loss_coeff * z if total is None else total + self.z_loss_coeff * z
        return total

    def _record(self, counts: Tensor, keep: Tensor, aux: Tensor | None) -> None:
        self._last_record = (counts.detach().cpu(), int((~keep).sum().item()), keep.numel())
        self._tokens += self._last_record[0]
        self._dropped += self._last_record[1]
        self._choices += self._last_record[2]
        self._aux.append(float(self._last_aux) if self._last_aux is not None else float("nan"))
        self._z.append(float(self._last_z) if self._last_z is not None else float("nan"))

    def forget_last(self) -> None:
        """Undo the statistics of the last forward (a pipeline's shape inference on placeholder inputs)."""
        if self._last_record is None:
            return
        counts, dropped, choices = self._last_record
        self._tokens -= counts
        self._dropped -= dropped
        self._choices -= choices
        self._aux.pop()
        self._z.pop()
        self._last_record = None


def _mean(values: list[float]) -> float:
    kept = [v for v in values if v == v]  # nan: the loss is off
    return sum(kept) / len(kept) if kept else 0.0


def moe_layers(module: nn.Module) -> dict[str, MoE]:
    """Every MoE layer under ``module``, by path."""
    return {name: m for name, m in module.named_modules() if isinstance(m, MoE)}
