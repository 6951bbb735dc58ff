"""Hugging Face MoE experts split over ep, with Hugging Face's own numerics.

transformers 5 keeps a MoE block's experts as one module (Mixtral, Qwen3-MoE, DeepSeek-V3: ``experts.gate_up_proj``
(E, 2I, H), ``experts.down_proj`` (E, H, I)) that the block calls with its router's choices, ``experts(hidden_states,
top_k_index, top_k_weights)``, and names the split in ``config.base_model_ep_plan``: the stacked weights
``grouped_gemm`` (dim 0 sharded), the module ``ep_dispatch_experts`` (tokens sent to their experts' ranks). Here:

- the router stays HF's (softmax or sigmoid scores, top-k, their normalization and scaling, DeepSeek's
  group-limited choice), and so do the shared experts: only the routed experts move;
- each ep rank keeps E/ep experts, every stacked tensor of the module a DTensor sharded on dim 0 over the ``expert``
  mesh under its own name (checkpoints and ``export-hf`` stay HF's), so ZeRO, clipping and checkpoints treat them as
  the package's own experts (:mod:`lightning_parallel.parallel.expert.apply`);
- the module's forward sends each (token, choice) pair to the rank holding its expert with the package's all-to-all
  (:func:`~lightning_parallel.parallel.expert.dispatch.dispatch`) and there runs HF's own experts forward
  (``config._experts_implementation``: grouped_mm, batched_mm or eager) on the local experts, each row once with
  weight 1; the outputs come back and are mixed by the routing weights on the token's rank;
- the load-balancing loss is HF's (``load_balancing_loss_func`` of Mixtral and Qwen-MoE, times the head's
  ``router_aux_loss_coef`` when ``config.output_router_logits``), over the global batch: :func:`router_aux_loss`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.causal_lm import _loss_pieces
from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.expert.apply import ExpertStyle, shard_expert_params
from lightning_parallel.parallel.expert.dispatch import dispatch
from lightning_parallel.parallel.tensor.plan import path_matches

# HF's expert-parallel styles (transformers.distributed.expert_parallel) and what they become here
DISPATCH, STACKED = "ep_dispatch_experts", "grouped_gemm"


class HFExperts(ExpertStyle):
    """``ep_dispatch_experts``: the experts module of one HF MoE block keeps its E/ep experts and receives its tokens
    by all-to-all (see the module docstring)."""

    def num_experts(self, module: nn.Module) -> int:
        return int(module.num_experts)

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> None:
        experts = self.num_experts(module)
        names = tuple(name for name, _ in module.named_parameters(recurse=False))
        odd = [n for n in names if getattr(module, n).dim() == 0 or getattr(module, n).shape[0] != experts]
        if odd:
            raise ValueError(
                f"{type(module).__name__}.{odd[0]} is not stacked by expert (dim 0 of {experts}), so ep cannot split "
                "it: set ep=1 for this model."
            )
        shard_expert_params(module, names, mesh)
        hf_forward = type(module).forward  # HF's own: dispatches on config._experts_implementation
        module.forward = functools.partial(_ep_forward, module, mesh.get_group(), hf_forward)


def hf_expert_parallel_plan(model: nn.Module) -> dict[str, ExpertStyle]:
    """``config.base_model_ep_plan`` as an expert plan, paths relative to the ``*ForCausalLM`` model; empty for a
    model without one (a dense model).

    Raises:
        ValueError: a style this package does not translate, or stacked weights outside an experts module.
    """
    base_plan = getattr(model.config, "base_model_ep_plan", None) or {}
    prefix = f"{model.base_model_prefix}."
    dispatched = [path for path, style in base_plan.items() if style == DISPATCH]
    for path, style in base_plan.items():
        if style not in (DISPATCH, STACKED) or (style == STACKED and path.rpartition(".")[0] not in dispatched):
            raise ValueError(
                f"expert-parallel style {style!r} for {path!r} in config.base_model_ep_plan is not supported (this "
                f"package splits {STACKED!r} weights of {DISPATCH!r} experts modules): use ep=1 for this model."
            )
    return {prefix + path: HFExperts() for path in dispatched}


@contextlib.contextmanager
def _local_experts(module: nn.Module, count: int) -> Iterator[None]:
    """HF's forward sees this rank's experts as plain tensors (autograd reaches the DTensors through ``to_local``)
    and ``num_experts`` the local count, for the duration of the call."""
    held = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    before = module.num_experts
    module._parameters.update({name: local(p) for name, p in held.items()})
    module.num_experts = count
    try:
        yield
    finally:
        module._parameters.update(held)
        module.num_experts = before


def _ep_forward(
    module: nn.Module, group: dist.ProcessGroup, hf_forward: Callable[..., Tensor], hidden_states: Tensor,
    top_k_index: Tensor, top_k_weights: Tensor,
) -> Tensor:  # fmt: skip
    def compute(rows: Tensor, counts: Tensor, largest: int | None) -> Tensor:
        experts, n = counts.numel(), rows.shape[0]
        with _local_experts(module, experts):
            if n == 0:  # one row through expert 0, none kept: the weights still get (zero) gradients on every rank
                probe = rows.sum(0, keepdim=True)
                return hf_forward(module, probe, counts.new_zeros(1, 1), probe.new_ones(1, 1))[:0]
            ids = torch.repeat_interleave(torch.arange(experts, device=rows.device), counts, output_size=n)
            return hf_forward(module, rows, ids.unsqueeze(-1), rows.new_ones(n, 1))

    out, _ = dispatch(hidden_states, top_k_index, top_k_weights, module.num_experts, compute, group)
    return out


def tp_plan_without_experts(base_plan: dict[str, str], config: Any) -> dict[str, str]:
    """``base_model_tp_plan`` less the entries of the experts ``base_model_ep_plan`` names (``packed_colwise``,
    ``moe_tp_experts``): experts are replicated over tp, split over ep only (as the package's own MoE layers)."""
    experts = [p for p, s in (getattr(config, "base_model_ep_plan", None) or {}).items() if s == DISPATCH]
    return {p: s for p, s in base_plan.items() if not any(p == e or p.startswith(e + ".") for e in experts)}


def has_router_aux_loss(model: nn.Module) -> bool:
    """True when HF's forward adds the load-balancing loss to its loss: the head has a ``router_aux_loss_coef``
    (Mixtral, Qwen-MoE; DeepSeek-V3 has none) and ``config.output_router_logits`` is on."""
    return hasattr(model, "router_aux_loss_coef") and bool(getattr(model.config, "output_router_logits", False))


def as_loss_like(loss: Tensor, aux: Tensor) -> Tensor:
    """``aux`` (the same on every tp rank) to add to ``loss``: replicated over the mesh of a vocabulary-parallel
    loss (a DTensor under tp), as it is."""
    if not isinstance(loss, DTensor):
        return aux
    return DTensor.from_local(aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)


def router_aux_of(output: Any, model: nn.Module, attention_mask: Tensor | None, trainer: Any) -> Tensor | None:
    """HF's load-balancing loss of a forward's ``output`` over the global batch (:func:`router_aux_loss`; the ranks
    that see different samples from the ``trainer``'s strategy), or None when HF's own forward would add none."""
    if not has_router_aux_loss(model):
        return None
    group, ranks, _ = _loss_pieces(trainer.strategy) if trainer is not None else (None, 1, 1)
    return router_aux_loss(output.router_logits, model, attention_mask, group, ranks)


def router_aux_loss(
    router_logits: tuple[Tensor, ...], model: nn.Module, attention_mask: Tensor | None, group: Any, ranks: int
) -> Tensor:
    """HF's ``load_balancing_loss_func`` of the whole batch of the ``ranks`` ranks in ``group`` (the ranks that see
    different samples; None and 1 in one process), each rank holding its samples' router logits (one (N, E) tensor
    per MoE layer).

    HF's loss is ``E * sum_e f_e * P_e`` with f_e the fraction of top-k choices of expert e and P_e its mean router
    probability, both over every layer and token (padding masked out): a product of two batch means, which no mean of
    per-rank losses gives. The sums behind f and P are all-reduced; the value returned is the global loss on every
    rank, and its gradient that rank's share of the global loss's gradient (f holds no gradient; P's sum is linear in
    each rank's probabilities) times ``ranks``, since the data-parallel reduction averages the gradients.
    """
    experts = model.num_experts
    counts, probs, rows = router_sums(router_logits, model, attention_mask)
    totals = torch.cat([counts, probs.detach(), rows.view(1)])
    if group is not None and ranks > 1:
        dist.all_reduce(totals, group=group)
    return balance_loss(totals, probs, experts, ranks)


def router_sums(
    router_logits: tuple[Tensor, ...] | list[Tensor], model: nn.Module, attention_mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The sums behind HF's load-balancing loss of some layers' router logits: (top-k choices per expert (E,), router
    probabilities per expert (E,) (with their gradient), rows), padding masked out; zeros for no layers."""
    experts, top_k = model.num_experts, model.num_experts_per_tok
    device = router_logits[0].device if router_logits else None
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        weights = torch.softmax(logits.to(device), dim=-1)  # HF's: in the logits' dtype
        chosen = torch.topk(weights, top_k, dim=-1)[1].reshape(-1)
        if mask is None:
            counts = counts.index_add(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
            probs = probs + weights.float().sum(0)
            rows = rows + weights.shape[0]
        else:
            counts = counts.index_add(0, chosen, mask.repeat_interleave(top_k))
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(0)
            rows = rows + mask.sum()
    return counts, probs, rows


def balance_loss(totals: Tensor, probs: Tensor, experts: int, ranks: int) -> Tensor:
    """HF's loss from the global ``totals`` (counts, probabilities, rows of every layer and rank, as one (2E+1,)
    tensor) whose gradient is that of this rank's ``probs`` (its share, times ``ranks``: see
    :func:`router_aux_loss`)."""
    counts, all_probs, rows = totals[:experts], totals[experts:-1], totals[-1]
    value = (counts / rows * all_probs / rows).sum() * experts  # HF's order of operations
    share = (counts / rows * probs / rows).sum() * (experts * ranks)  # this rank's part of the gradient, times ranks
    return value + (share - share.detach())


def moe_block_paths(config: Any) -> list[str]:
    """The MoE blocks' paths in the base model (``layers.*.mlp``): the parents of the ``ep_dispatch_experts``
    modules of ``config.base_model_ep_plan``."""
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    return [path.rpartition(".")[0] for path, style in ep_plan.items() if style == DISPATCH]


def resolve_moe_block_entries(
    model: nn.Module, plan: dict[str, ParallelStyle], prefix: str, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """``plan`` (paths relative to ``model``, the base model at ``prefix``) with every entry at or under a MoE block
    path (``layers.*.mlp``) resolved to the layers that hold its module, the MoE blocks themselves left out.

    Qwen3-MoE and DeepSeek-V3 name dense MLPs (``mlp.gate_proj``: the dense layers, DeepSeek's shared experts) at
    the path of their MoE blocks: those split as any dense MLP, the block of a dense layer taking its input once,
    while a MoE block keeps its input as it comes (its router and the experts over ep see plain hidden states).

    Raises:
        ValueError: ``sequence_parallel`` with a MoE model whose router sees the sequence split over tp (HF's
            auxiliary loss would miss the other tp ranks' tokens) or whose attention the tp plan does not split
            (DeepSeek-V3's: it would attend within a slice).
    """
    blocks = [prefix + path for path in moe_block_paths(model.config)]
    if not blocks:
        return plan
    if sequence_parallel:
        _check_moe_sequence_parallel(model, plan)
    modules = dict(model.named_modules())
    resolved: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        block = next((b for b in blocks if path == b or path.startswith(b + ".")), None)
        if block is None:
            resolved[path] = style
            continue
        for name in modules:
            if path_matches(name, path) and not (path == block and f"{name}.experts" in modules):
                resolved[name] = style
    return resolved


def _check_moe_sequence_parallel(model: nn.Module, plan: dict[str, ParallelStyle]) -> None:
    kind = model.config.model_type
    if has_router_aux_loss(model):
        raise ValueError(
            f"sequence_parallel=True with this {kind} model and config.output_router_logits=True: each tp rank "
            "routes its slice of the sequence, and HF's load-balancing loss needs every token's router. Set "
            "sequence_parallel=False, or output_router_logits=False."
        )
    if not any(".self_attn." in path for path in plan):
        raise ValueError(
            f"sequence_parallel=True with this {kind} model: its tp plan (config.base_model_tp_plan) does not "
            "split attention, which would then see a slice of the sequence. Set sequence_parallel=False."
        )
