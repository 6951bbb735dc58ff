"""The reference model of DPO, three ways (``dpo.reference``), and what each holds in memory:

- ``adapters`` (with LoRA): the policy's own base with its adapters switched off (peft's ``disable_adapter()``;
  LitGPT's LoRA layers with their rank set to 0, :mod:`.litgpt`): no second copy, nothing more in memory;
- ``copy`` (without): a frozen copy of the model, a submodule of the LightningModule (``reference_model``), so every
  layout splits it as it splits the policy: its tensor-parallel plan (and a MoE's expert plan) is the policy's under
  the copy's names, ZeRO-3 makes its blocks units of their own (sharded over the same ranks), ZeRO 0-2 keep it whole
  (it has no gradient and no optimizer state); under pp each rank keeps the copy's layers of its own stages
  (:func:`split_like`: the others become placeholders, as the policy's did) and the reference's forward walks the
  copy's stages in order, one point-to-point send and receive per stage boundary (:func:`copy_pipeline`, the policy's
  forward-only walk; a copy's stages are not ZeRO-3 units: whole on the ranks of their stage); its values are the
  policy's initial ones, copied shard by shard once the model is split;
- ``precomputed`` (``dpo.precompute_reference=true``): the summed answer log-probabilities of every pair by the model
  as it starts, computed in one pass before training (each data-parallel rank its share, gathered) and kept with the
  pairs: 8 bytes a pair.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.materialize import allocate
from lightning_parallel.parallel.pipeline.runner import Pipeline
from lightning_parallel.parallel.pipeline.split import ElsewhereLayer, PipelineSplit, StageModule
from lightning_parallel.preference.litgpt import is_litgpt, litgpt_adapters_off

REFERENCES = ("adapters", "copy", "precomputed")
COPY_NAME = "reference_model"


def choose_reference(lora: bool, precompute: bool) -> str:
    """The reference's kind for these settings: precomputed when asked, else the LoRA base, else a frozen copy."""
    if precompute:
        return "precomputed"
    return "adapters" if lora else "copy"


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """peft's ``disable_adapter()`` for the LoRA layers this rank holds: the base alone in the block. peft's own
    context refuses a model without any adapter layer, which a pipeline stage may be (a last stage holding the head
    alone); this one switches off those there are. LitGPT's LoRA: :func:`.litgpt.litgpt_adapters_off`."""
    if is_litgpt(model):
        with litgpt_adapters_off(model):
            yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (on the meta device too, when it is there) with no parameter trained."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    ref.eval()
    return ref


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


@contextlib.contextmanager
def hidden(module: nn.Module, name: str) -> Iterator[nn.Module | None]:
    """``module``'s child ``name`` taken out of it for the block (a materialization that must not see it)."""
    child = module._modules.pop(name, None)
    try:
        yield child
    finally:
        if child is not None:
            module._modules[name] = child


@torch.no_grad()
def fill_from(reference: nn.Module, policy: nn.Module, device: torch.device) -> None:
    """The reference's storage given the policy's values: each rank's own pieces copied one to one where the copy is
    split as the policy is (same plan, same units); where it is not (under pp the copy's stages are no ZeRO-3 units)
    the policy's tensor gathered whole, then this rank's piece of the copy's placements taken from it (every rank of
    the policy's groups runs the same gathers, in the same order)."""
    allocate(reference, device, device)
    theirs = dict(policy.named_parameters()) | dict(policy.named_buffers())
    for name, tensor in [*reference.named_parameters(), *reference.named_buffers()]:
        source = theirs.get(name)
        if source is None:
            raise RuntimeError(f"the reference copy's {name} has no counterpart in the policy")
        local(tensor).copy_(_piece_for(tensor, source))


def _piece_for(target: Tensor, source: Tensor) -> Tensor:
    """This rank's piece of ``source``'s values laid out as ``target`` is."""
    if not isinstance(source, DTensor) or _same_layout(target, source):
        return local(source)
    whole = source.full_tensor()
    if not isinstance(target, DTensor):
        return whole
    # the same whole tensor on every rank: each cuts its own piece, nothing sent
    return distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()


def split_like(reference: nn.Module, policy: nn.Module) -> None:
    """Under pp: ``reference`` (the policy's copy) keeps the layers of this rank's stages alone, each layer the
    policy's split left to another rank a placeholder in the copy too (in place; again: nothing more)."""
    for name, layer in policy.named_modules():
        if isinstance(layer, ElsewhereLayer) and not isinstance(reference.get_submodule(name), ElsewhereLayer):
            parent, _, attr = name.rpartition(".")
            setattr(reference.get_submodule(parent) if parent else reference, attr, ElsewhereLayer(name, layer.stage))


def copy_pipeline(reference: nn.Module, policy: nn.Module, pipeline: Pipeline) -> Pipeline:
    """A forward-only :class:`Pipeline` over ``reference``'s layers of the policy's stages (``pipeline``'s split, each
    layer by its name in ``policy``; ``reference`` split as :func:`split_like` does), on the policy's ranks, group
    and loss function: its ``eval_loss`` walks the stages in order (no schedule, so the same point-to-point orders
    under every schedule), the loss on the last stage."""
    split_like(reference, policy)
    names = {id(m): name for name, m in policy.named_modules()}
    policy_split = pipeline.split
    stages = {
        index: StageModule([reference.get_submodule(names[id(layer)]) for layer in stage.layers])
        for index, stage in policy_split.stages.items()
    }
    split = PipelineSplit(stages, policy_split.num_stages, list(policy_split.stage_ranks), [])
    return Pipeline(split, pipeline.spec.name, pipeline.microbatches, pipeline.group, pipeline.device, pipeline.loss_fn)


def _same_layout(target: Tensor, source: DTensor) -> bool:
    return (
        isinstance(target, DTensor)
        and target.device_mesh == source.device_mesh
        and tuple(target.placements) == tuple(source.placements)
    )


def parameter_bytes(module: nn.Module | None) -> int:
    """Bytes this rank holds of ``module``'s parameters (its shards)."""
    if module is None:
        return 0
    return sum(local(p).numel() * local(p).element_size() for p in module.parameters())


def reference_bytes(kind: str, module: Any, precomputed: Tensor | None) -> int:
    """What the reference adds to this rank's memory: 0 for adapters, the copy's parameter shards, the cached
    log-probabilities."""
    if kind == "copy":
        return parameter_bytes(getattr(module, COPY_NAME, None))
    if kind == "precomputed" and precomputed is not None:
        return precomputed.numel() * precomputed.element_size()
    return 0
