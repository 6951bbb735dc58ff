"""A Mixture-of-Experts layer in pure torch: a drop-in replacement for a transformer FFN (Shazeer et al. 2017,
GShard, Switch Transformer, Mixtral).

- Router: a linear gate computed in fp32 also under autocast (Switch's selective precision: a bf16 router flips
  near-tied choices between layouts), softmax, top-k (k >= 1; the k weights renormalized to sum to 1 when k > 1).
- Experts: stacked weights (E x d x f, E x f x d) computed as one grouped GEMM on CUDA, or as its twin elsewhere,
  one batched matmul over the experts with each expert's tokens padded to the largest count (no Python loop over
  experts either way: :mod:`.experts`); ``gelu`` or ``swiglu``; optional shared expert (an FFN every token goes
  through, DeepSeek-MoE).
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
gradients) since the last ``reset_stats()``. They are summed on the layer's device, with no host sync in the
forward; ``stats()`` reads them on the host, ``totals()`` hands them over on the device (the monitor reduces them
there).

Host syncs in a forward: none without expert parallelism on the grouped kernel (CUDA's in bf16; dropless: the
capacity mask's kept count is one), the largest count on the padded one; with expert parallelism one copy of the
counts, for the all-to-all's split sizes (:mod:`.dispatch`), which also gives the padded kernel its width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel._compat import in_backward
from lightning_parallel.parallel.expert.aux import AttachAuxLoss
from lightning_parallel.parallel.expert.dispatch import dispatch
from lightning_parallel.parallel.expert.experts import GroupedExperts, expert_forward

__all__ = ["ACTIVATIONS", "GroupedExperts", "MoE", "check_moe_settings", "expert_forward", "moe_layers"]

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


class Router(nn.Linear):
    """The gate's linear layer, computed in fp32 also under autocast and from bf16 weights (Switch's selective
    precision: a bf16 router flips near-tied choices between layouts). ZeRO-3 under bf16-mixed gathers it in fp32 as
    a unit of its own (``data/fsdp.py: router_units``)."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


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
        self.router = Router(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden, activation)
        self.shared: nn.Module | None = None
        if shared_hidden:
            self.shared = nn.Sequential(nn.Linear(dim, shared_hidden), nn.GELU(), nn.Linear(shared_hidden, dim))
        self.ep_group: dist.ProcessGroup | None = None  # set by apply_expert_parallel
        self.reset_stats()

    # ----- statistics -----

    def reset_stats(self) -> None:
        # (E + 3,) float64 on the layer's device: kept choices per expert, dropped choices, load-balancing loss, z-loss
        self._sums: Tensor | None = None
        self._forwards = 0  # training forwards recorded
        self._choices = 0  # the (token, choice) pairs they routed
        self._last: tuple[Tensor, int] | None = None
        self._unrecorded: tuple[Tensor, int] | None = None  # a compiled forward's figures (see flush_stats)

    def totals(self) -> tuple[Tensor, int, int]:
        """Since the last reset, on the layer's device (no host sync): the (E + 3,) float64 sums over this rank's
        training forwards of the kept choices per expert, the dropped choices, the load-balancing loss and the
        z-loss (0 when off); the number of those forwards; the (token, choice) pairs they routed."""
        self.flush_stats()
        if self._sums is None:
            device = self.router.weight.device
            return torch.zeros(self.num_experts + 3, dtype=torch.float64, device=device), 0, 0
        return self._sums.clone(), self._forwards, self._choices

    def stats(self) -> dict[str, Any]:
        """Since the last reset, on the host: tokens routed to each expert (kept choices, this rank's tokens), the
        fraction of choices dropped for capacity, and the mean load-balancing and z-losses."""
        sums, forwards, choices = self.totals()
        values = sums.tolist()
        dropped, aux, z = values[self.num_experts :]
        return {
            "tokens_per_expert": [int(count) for count in values[: self.num_experts]],
            "dropped_fraction": dropped / choices if choices else 0.0,
            "aux_loss": aux / forwards if forwards else 0.0,
            "z_loss": z / forwards if forwards else 0.0,
        }

    # ----- forward -----

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        per_sample = shape[-2] if x.dim() >= 3 else 1
        samples = tokens.shape[0] // per_sample
        logits = self.router(tokens)  # fp32 (Router); called as a module so ZeRO-3 gathers it as its own unit
        probs = logits.softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        weights = top_p / top_p.sum(-1, keepdim=True) if self.top_k > 1 else top_p
        keep = self._capacity_keep(top_i, samples, per_sample)  # None: dropless
        out, counts = dispatch(tokens, top_i, weights, self.num_experts, self.experts, self.ep_group, keep)
        if self.shared is not None:
            out = out + self.shared(tokens)
        aux = self._aux_loss(logits, probs, top_i, samples, per_sample)
        if aux is not None and torch.is_grad_enabled():
            out = AttachAuxLoss.apply(out, aux)
        if torch.is_grad_enabled():
            # training forwards only: not evaluation, a pipeline's shape inference, or a checkpointed layer's recompute
            row = self._stats_row(counts, keep)
            if torch.compiler.is_compiling():
                # no graph break on autograd's state or Python counters: the compiled layer's eager wrapper
                # (compile_layers) records it through flush_stats()
                self._unrecorded = (row, top_i.numel())
            elif not in_backward():
                self._record(row, top_i.numel())
        return out.view(shape)

    def flush_stats(self) -> None:
        """Record the figures a compiled forward left (eager: outside a checkpointed layer's recompute)."""
        unrecorded, self._unrecorded = self._unrecorded, None
        if unrecorded is not None and not in_backward():
            self._record(*unrecorded)

    def _capacity_keep(self, top_i: Tensor, samples: int, per_sample: int) -> Tensor | None:
        if self.capacity_factor is None:
            return None
        k, experts = self.top_k, self.num_experts
        capacity = math.ceil(self.capacity_factor * per_sample * k / experts)
        # per sample, in priority order: every token's first choice, then every second choice, ...
        order = top_i.view(samples, per_sample, k).transpose(1, 2).reshape(samples, k * per_sample)
        onehot = _one_hot(order, experts)
        position = (onehot.cumsum(1) - 1).gather(2, order.unsqueeze(-1)).squeeze(-1)
        keep = position < capacity
        return keep.view(samples, k, per_sample).transpose(1, 2).reshape(-1, k)

    def _aux_loss(self, logits: Tensor, probs: Tensor, top_i: Tensor, samples: int, per_sample: int) -> Tensor | None:
        self._last_aux = self._last_z = None
        total = None
        if self.aux_loss_coeff:
            experts, k = self.num_experts, self.top_k
            chosen = _one_hot(top_i.view(samples, per_sample * k), experts).sum(1).to(probs.dtype)
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

    def _stats_row(self, counts: Tensor, keep: Tensor | None) -> Tensor:
        """This forward's (E + 3,) float64 figures (see :meth:`totals`), on the device (no host sync)."""
        f64 = torch.float64
        zero = torch.zeros((), dtype=f64, device=counts.device)
        dropped = (~keep).sum().to(f64) if keep is not None else zero
        aux, z = (zero if v is None else v.to(f64) for v in (self._last_aux, self._last_z))
        return torch.cat([counts.detach().to(f64), torch.stack([dropped, aux, z])])

    def _record(self, row: Tensor, choices: int) -> None:
        """Add one forward's figures to the sums, on the device (no host sync)."""
        before = torch.zeros_like(row) if self._sums is None else self._sums.to(row.device)
        self._sums = before + row  # out of place: forget_last restores ``before`` (placeholder inputs may be NaN)
        self._forwards += 1
        self._choices += choices
        self._last = (before, choices)

    def forget_last(self) -> None:
        """Undo the statistics of the last forward (a pipeline's shape inference on placeholder inputs, whose
        uninitialized values may be NaN: the sums before it are put back, not the row subtracted)."""
        if self._last is None or self._sums is None:
            return
        before, choices = self._last
        self._sums = before
        self._forwards -= 1
        self._choices -= choices
        self._last = None


def _one_hot(ids: Tensor, classes: int) -> Tensor:
    """``F.one_hot(ids, classes)`` without its range checks, which read the ids' min and max on the host off CUDA."""
    return torch.zeros((*ids.shape, classes), dtype=torch.long, device=ids.device).scatter_(-1, ids.unsqueeze(-1), 1)


def moe_layers(module: nn.Module) -> dict[str, MoE]:
    """Every MoE layer under ``module``, by path."""
    return {name: m for name, m in module.named_modules() if isinstance(m, MoE)}
