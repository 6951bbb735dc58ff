"""The reference model of DPO, three ways (``dpo.reference``), and what each holds in memory:

- ``adapters`` (with LoRA): the policy's own base with its adapters switched off (peft's ``disable_adapter()``;
  LitGPT's LoRA layers with their rank set to 0, :mod:`.litgpt`): no second copy, nothing more in memory;
- ``copy`` (without): a frozen copy of the model, a submodule of the LightningModule (``reference_model``), so every
  layout splits it as it splits the policy: its tensor-parallel plan (and a MoE's expert plan) is the policy's under
  the copy's names, ZeRO-3 makes its blocks units of their own (sharded over the same ranks), ZeRO 0-2 keep it whole
  (it has no gradient and no optimizer state); its values are the policy's initial ones, copied shard by shard once
  the model is split;
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

from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.materialize import allocate
from lightning_parallel.preference.litgpt import is_litgpt, litgpt_adapters_off

REFERENCES = ("adapters", "copy", "precomputed")
COPY_NAME = "reference_model"


def choose_reference(lora: bool, precompute: bool, pp: int = 1) -> str:
    """The reference's kind for these settings.

    Raises:
        ValueError: a reference that cannot be built here, and why.
    """
    if precompute:
        return "precomputed"
    if lora:
        return "adapters"
    if pp > 1:
        raise ValueError(
            f"dpo with peft=none and strategy.pp={pp}: the frozen reference copy is not split into pipeline stages "
            "(it would need a pipeline of its own): set dpo.precompute_reference=true (one pass before training), "
            "use peft=lora (the base with adapters off is the reference), or pp=1."
        )
    return "copy"


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
    """The reference's storage (split as the policy's: same plan, same units) given the policy's values, each rank's
    own pieces copied one to one."""
    allocate(reference, device, device)
    theirs = dict(policy.named_parameters()) | dict(policy.named_buffers())
    for name, tensor in [*reference.named_parameters(), *reference.named_buffers()]:
        source = theirs.get(name)
        if source is None:
            raise RuntimeError(f"the reference copy's {name} has no counterpart in the policy")
        local(tensor).copy_(local(source))


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
