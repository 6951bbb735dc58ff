"""Hugging Face's load-balancing loss under pp: each stage holds some of the routers the loss combines.

HF's loss of a batch is ``E * sum_e f_e * P_e`` with f the fraction of top-k choices of expert e and P its mean
router probability, both over every MoE layer and token (:func:`~lightning_parallel.hf.experts.router_aux_loss`).
Its value needs the sums of every stage, and the gradient each stage's routers get needs the choice counts of every
stage (``E * counts / rows**2`` per router probability): the later stages' counts exist only once they have run the
microbatch's forward. So, per microbatch of a schedule's step, beside the schedule's own transfers (on a process
group of their own, matched in microbatch order):

- each stage but the last sums its routers' logits at the end of its forward (counts, probabilities, rows) and sends
  them to the last stage; its output carries the probabilities' sum into the backward (:class:`_CountsInBackward`);
- the last stage, computing the microbatch's loss, adds the other stages' sums to its own, all-reduces them over the
  data-parallel ranks (the global batch's loss, as in one process) and sends the totals back: HF's value, with the
  gradient of its own layers' share;
- each earlier stage's backward of that microbatch receives the totals and gives its probabilities their gradient,
  the factor its loss carries (:func:`~lightning_parallel.parallel.expert.aux.backward_scale`) included.

Each pipeline microbatch is its own batch for the loss, as each micro-batch of gradient accumulation is (HF's loss
is a product of batch means). Forward-only passes (validation, shape inference) add no auxiliary loss under pp.

The sums and the totals travel on two process groups of the pipeline ranks, one per direction (``up``: the earlier
stages' sends of sums to the last stage; ``down``: its replies). On NCCL the operations between two ranks of one
group run in issue order and a send completes only when its receive runs; on one group, 1F1B's warm-up and GPipe
queue ``send(sums of microbatch 1)`` before ``recv(totals of microbatch 0)`` on an earlier stage while the last
stage queues ``send(totals 0)`` before ``recv(sums 1)``: a deadlock (gloo buffers the sends and hid it). On two
groups each pair sees sends one way only, matched in microbatch order, under every schedule.
``_ONE_GROUP`` (private, for tests/test_hf_moe_pipeline_order.py) restores the single group, to show strict mode
(``LP_STRICT_COLLECTIVES``) failing on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.causal_lm import _loss_pieces
from lightning_parallel.hf.experts import balance_loss, has_router_aux_loss, router_sums
from lightning_parallel.hf.families import hf_pipeline_layers
from lightning_parallel.parallel.expert.aux import backward_scale
from lightning_parallel.parallel.pipeline.runner import scheduled_chunk, stage_inputs
from lightning_parallel.parallel.pipeline.split import ElsewhereLayer

_ONE_GROUP = False  # the old exchange, both directions on one group: deadlocks on NCCL (see the module docstring)


class PipelineRouterAux:
    """This rank's part of HF's load-balancing loss under pp (see the module docstring).

    Args:
        model: the HF ``*ForCausalLM`` model, split over the stages.
        layers: its pipeline layers in order (``hf_pipeline_layers``), other stages' as ``ElsewhereLayer``.
        up: a process group of this rank's pipeline ranks in stage order, for the sums sent to the last stage only.
        down: one more of them, for the totals sent back only (``up`` itself restores the old, crossing order).
        batch_group: the ranks that see different samples (None alone); batch_ranks: their number.

    Raises:
        ValueError: this rank holds more than one stage (interleaved schedules), or the first stage trains nothing.
    """

    def __init__(
        self, model: nn.Module, layers: list[nn.Module], up: Any, down: Any, batch_group: Any, batch_ranks: int
    ) -> None:
        held = [i for i, layer in enumerate(layers) if not isinstance(layer, ElsewhereLayer)]
        if held != list(range(held[0], held[-1] + 1)):
            raise ValueError(
                "output_router_logits=True under pp needs one pipeline stage per rank (HF's load-balancing loss "
                "exchanges each stage's router sums): use a single-stage schedule (1F1B, GPipe), or "
                "output_router_logits=False."
            )
        first_frozen = held[0] == 0 and not any(p.requires_grad for i in held for p in layers[i].parameters())
        if first_frozen and held[-1] < len(layers) - 1:
            raise ValueError(
                "output_router_logits=True under pp with a first pipeline stage that trains nothing (every parameter "
                "of its layers frozen, as LoRA adapters only on later layers leave it): its backward never runs, so "
                "it would not take the last stage's totals of HF's load-balancing loss: put adapters on the first "
                "stage's layers too (peft target_modules), or set output_router_logits=False."
            )
        self.model, self.up, self.down, self.batch_group, self.batch_ranks = model, up, down, batch_group, batch_ranks
        self.peers = dist.get_process_group_ranks(up)
        self.is_last = held[-1] == len(layers) - 1
        self.experts = int(model.num_experts)
        self.logits: list[Tensor] = []
        self.stash: tuple[Tensor, Tensor, Tensor] | None = None
        self.sends: list[tuple[Any, Tensor]] = []  # (work, buffer) of sends not yet waited for
        spec = type(model)._can_record_outputs["router_logits"]
        self.index = spec.index
        routers = [m for i in held for m in layers[i].modules() if isinstance(m, spec.target_class)]
        self.hooks = [m.register_forward_hook(self._record) for m in routers]
        self.hooks.append(layers[held[-1]].register_forward_hook(self._stage_end))

    def _record(self, module: nn.Module, args: tuple, output: Any) -> None:
        if scheduled_chunk() is not None and torch.is_grad_enabled():
            self.logits.append(output[self.index])

    def _stage_end(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        logits, self.logits = self.logits, []
        if scheduled_chunk() is None or not torch.is_grad_enabled():
            return None
        if logits:
            counts, probs, rows = router_sums(logits, self.model, stage_inputs().get("attention_mask"))
        else:  # a stage without MoE layers takes part all the same
            counts = probs = torch.zeros(self.experts, dtype=torch.float32, device=output.device)
            rows = torch.zeros((), dtype=torch.float32, device=output.device)
        if self.is_last:
            self.stash = counts, probs, rows
            return None
        self._send(torch.cat([counts, probs.detach(), rows.view(1)]), self.peers[-1], self.up)
        return _CountsInBackward.apply(output, probs, self)

    def _send(self, tensor: Tensor, dst: int, group: Any) -> None:
        self.sends.append((dist.isend(tensor, dst, group=group), tensor))

    def receive(self, size: int, src: int, device: torch.device, group: Any) -> Tensor:
        buffer = torch.empty(size, dtype=torch.float32, device=device)
        dist.recv(buffer, src, group=group)
        return buffer

    def finish(self) -> Tensor | None:
        """On the last stage, in the microbatch's loss: HF's load-balancing loss of the microbatch over every stage
        and data-parallel rank (None outside a schedule's training step)."""
        if self.stash is None:
            return None
        (counts, probs, rows), self.stash = self.stash, None
        totals = torch.cat([counts, probs.detach(), rows.view(1)])
        for src in self.peers[:-1]:
            totals = totals + self.receive(totals.numel(), src, totals.device, self.up)
        if self.batch_group is not None and self.batch_ranks > 1:
            dist.all_reduce(totals, group=self.batch_group)
        reply = torch.cat([totals[: self.experts], totals[-1:]])
        for dst in self.peers[:-1]:
            self._send(reply, dst, self.down)
        return balance_loss(totals, probs, self.experts, self.batch_ranks)

    def flush(self) -> None:
        """Wait for the sends of the step (each is received within the step of its receiver)."""
        sends, self.sends = self.sends, []
        for work, _ in sends:
            work.wait()

    def close(self) -> None:
        self.flush()
        for hook in self.hooks:
            hook.remove()


def pipeline_router_aux(model: nn.Module, strategy: Any) -> PipelineRouterAux | None:
    """The exchange of HF's load-balancing loss for ``model`` split by ``strategy`` (a mesh strategy with pp > 1 and
    ``config.output_router_logits`` on), or None where HF's own forward computes it. Called on every rank once the
    model is split and before training (it makes a process group of the pipeline ranks).

    Raises:
        ValueError: with activation checkpointing, or more than one stage per rank (not supported yet).
    """
    dims = getattr(strategy, "parallel_dims", None)
    if dims is None or dims.pp == 1 or not has_router_aux_loss(model):
        return None
    recompute = getattr(getattr(strategy, "config", None), "activation_checkpointing", "none")
    if recompute != "none":
        raise ValueError(
            f"activation_checkpointing={recompute!r} with pp={dims.pp} and config.output_router_logits=True is not "
            "supported yet (a recomputed layer would not take part in the stages' exchange of router sums): set "
            "activation_checkpointing='none', or output_router_logits=False."
        )
    ranks = dist.get_process_group_ranks(strategy.mesh.group("stage"))
    up = strategy.mesh.side_group(ranks)
    down = up if _ONE_GROUP else strategy.mesh.side_group(ranks)
    batch_group, batch_ranks, _ = _loss_pieces(strategy)
    return PipelineRouterAux(model, hf_pipeline_layers(model), up, down, batch_group, batch_ranks)


class _CountsInBackward(torch.autograd.Function):
    """A stage's output unchanged; in backward, its routers' probability sums (E,) get HF's loss's gradient from the
    totals the last stage sends back: ``coef * scale * E * ranks * counts / rows**2``."""

    @staticmethod
    def forward(ctx, output: Tensor, probs: Tensor, aux: PipelineRouterAux) -> Tensor:
        ctx.aux = aux
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        aux: PipelineRouterAux = ctx.aux
        totals = aux.receive(aux.experts + 1, aux.peers[-1], grad.device, aux.down)
        counts, rows = totals[:-1], totals[-1]
        factor = aux.model.router_aux_loss_coef * backward_scale() * aux.experts * aux.batch_ranks
        return grad, counts / rows / rows * factor, None
