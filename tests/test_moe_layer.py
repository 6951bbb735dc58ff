"""The MoE layer in one process: it computes what a per-token loop over the chosen experts computes, its capacity
drops and auxiliary losses depend on each sample alone (so any split of a batch gives the same), and its auxiliary
losses reach the gradient exactly as ``coeff * aux`` added to the loss, at the scale the main loss carries."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel.parallel.expert import MoE, aux_loss_scale
from lightning_parallel.parallel.expert.dispatch import grouped_by_local_expert


def loop_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through its top-k experts one by one (dropless)."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = moe.router(tokens).float().softmax(-1)
    top_p, top_i = probs.topk(moe.top_k, dim=-1)
    weights = top_p / top_p.sum(-1, keepdim=True) if moe.top_k > 1 else top_p
    e = moe.experts
    out = torch.zeros_like(tokens)
    for n in range(tokens.shape[0]):
        for j in range(moe.top_k):
            i = top_i[n, j]
            h = tokens[n] @ e.w1[i]
            h = F.silu(h) * (tokens[n] @ e.w3[i]) if e.w3 is not None else F.gelu(h)
            out[n] += weights[n, j] * (h @ e.w2[i])
    if moe.shared is not None:
        out = out + moe.shared(tokens)
    return out.view(x.shape)


@pytest.mark.parametrize("activation,top_k,shared", [("gelu", 2, 0), ("swiglu", 1, 0), ("gelu", 3, 8)])
def test_moe_equals_a_loop_over_the_chosen_experts(activation, top_k, shared):
    torch.manual_seed(0)
    moe = MoE(16, 24, 6, top_k, activation=activation, shared_hidden=shared)
    x = torch.randn(3, 7, 16)
    torch.testing.assert_close(moe(x), loop_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_capacity_drops_and_aux_losses_are_per_sample():
    """A batch gives the same outputs, drops and auxiliary loss as its halves run apart (what any dp, pp or ep split
    does), and the per-sample capacity holds."""
    torch.manual_seed(1)
    moe = MoE(8, 16, 4, 2, capacity_factor=0.5, z_loss_coeff=0.1)
    x = torch.randn(4, 10, 8)
    whole = moe(x)
    whole_stats = moe.stats()
    moe.reset_stats()
    halves = torch.cat([moe(x[:2]), moe(x[2:])])
    half_stats = moe.stats()
    torch.testing.assert_close(whole, halves)
    assert whole_stats["tokens_per_expert"] == half_stats["tokens_per_expert"]
    assert whole_stats["dropped_fraction"] == half_stats["dropped_fraction"] > 0
    assert whole_stats["aux_loss"] == pytest.approx(half_stats["aux_loss"], rel=1e-6)
    assert whole_stats["z_loss"] == pytest.approx(half_stats["z_loss"], rel=1e-6)
    capacity = math.ceil(0.5 * 10 * 2 / 4)
    assert max(whole_stats["tokens_per_expert"]) <= capacity * 4  # 4 samples, each at most `capacity` per expert


def test_aux_loss_gradient_is_coeff_times_aux_at_the_main_loss_scale():
    torch.manual_seed(2)
    moe = MoE(8, 16, 4, 2, aux_loss_coeff=0.3, z_loss_coeff=0.05)
    x = torch.randn(2, 5, 8)
    scale = 0.25  # e.g. 1 / accumulate_grad_batches

    with aux_loss_scale(scale):
        (moe(x).square().mean() * scale).backward()
    got = moe.router.weight.grad.clone()
    moe.zero_grad()

    # the same objective written out: main + 0.3 * balance + 0.05 * z, every term scaled alike
    tokens = x.reshape(-1, 8)
    logits = moe.router(tokens).float()
    probs = logits.softmax(-1)
    _, top_i = probs.topk(2, -1)
    chosen = F.one_hot(top_i.view(2, 10), 4).sum(1).float() / 10
    balance = (4 * (chosen * probs.view(2, 5, 4).mean(1)).sum(-1)).mean()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    main = loop_reference(moe, x).square().mean()
    ((main + 0.3 * balance + 0.05 * z) * scale).backward()
    torch.testing.assert_close(got, moe.router.weight.grad, rtol=1e-5, atol=1e-7)


def test_received_rows_are_grouped_by_local_expert():
    # 2 source ranks x 3 local experts: rows arrive per source, in local-expert order within each
    counts = torch.tensor([[1, 0, 2], [2, 1, 0]])
    perm, local_counts = grouped_by_local_expert(counts)
    expert_of_row = torch.tensor([0, 2, 2, 0, 0, 1])
    assert expert_of_row[perm].tolist() == [0, 0, 0, 1, 2, 2]
    assert perm.tolist() == [0, 3, 4, 5, 1, 2]  # sources in rank order within an expert
    assert local_counts.tolist() == [3, 1, 2]


def test_evaluation_forwards_are_not_counted():
    moe = MoE(8, 16, 4, 2)
    with torch.no_grad():
        moe(torch.randn(2, 3, 8))
    assert sum(moe.stats()["tokens_per_expert"]) == 0
    moe(torch.randn(2, 3, 8))
    assert sum(moe.stats()["tokens_per_expert"]) == 12
    moe.forget_last()
    assert sum(moe.stats()["tokens_per_expert"]) == 0


@pytest.mark.slow  # two compilations: ~30 s on a busy 2-core machine
def test_a_compiled_block_records_the_same_figures_without_breaking_on_them():
    """Inside a layer compiled by compile_layers the routing figures are left for the eager wrapper (flush_stats):
    the same totals as eager, and no graph break on autograd's state (``in_backward``) or the Python counters; a
    checkpointed layer's recompute in backward is not counted."""
    from torch.utils.checkpoint import checkpoint

    from lightning_parallel.parallel.parallelize import _compiled_outside_dispatch_modes

    torch.manual_seed(0)
    eager, compiled = MoE(8, 16, 4, 2, aux_loss_coeff=0.01), MoE(8, 16, 4, 2, aux_loss_coeff=0.01)
    compiled.load_state_dict(eager.state_dict())
    forward = _compiled_outside_dispatch_modes(compiled.forward, [compiled])
    x = torch.randn(2, 3, 8)
    for _ in range(2):
        eager(x).sum().backward()
        checkpoint(forward, x.requires_grad_(), use_reentrant=False).sum().backward()
    assert compiled.totals()[1:] == eager.totals()[1:] == (2, 24)
    torch.testing.assert_close(compiled.totals()[0], eager.totals()[0])
    explained = torch._dynamo.explain(compiled.forward)(x)
    reasons = " ".join(str(r.reason) for r in explained.break_reasons)
    assert "graph_task" not in reasons and "non-Tensor" not in reasons, reasons
