"""Activation checkpointing (recomputation) of a model's layers: ``none``, ``full`` or ``selective``. Pure torch.

- ``full``: each layer keeps only its input; everything inside it is recomputed in backward.
- ``selective``: torchtitan's op-level selective checkpointing: inside each layer the outputs of the
  expensive ops (matmuls, convolutions, attention, sequence-parallel reduce-scatters; :data:`SAVED_OPS`) are
  kept and the cheap ones (norms, activations, dropout, residual adds, views) are recomputed. Not under a
  split backward that runs twice (zero-bubble pipelines): torch keeps its saved outputs for one backward only.
  The other selective flavour, full checkpointing of every k-th layer, is
  ``apply_activation_checkpointing(layers[::k], "full")``.

Which layers: the model's ``pipeline_layers()`` when it has them (GPT blocks, VGG conv groups, your own
layers), else the children of its outermost ``ModuleList``/``Sequential`` containers (the repeated blocks).

What torch leaves to us, and this module adds: torch's ``checkpoint_wrapper`` puts each layer inside a
wrapper module, which inserts ``_checkpoint_wrapped_module.`` into every parameter name, tensor-parallel
plan path and checkpoint key. Here the layer itself stays where it is and only its ``forward`` is replaced,
so names do not change. Hooks on the layer itself (FSDP2's gather and free, a tensor-parallel input layout)
stay outside the recomputed region, as with torchtitan's wrapper order; those of its submodules (the
tensor-parallel splits) are recomputed with it, collectives included. Buffers a forward updates in place
(BatchNorm's running statistics) are restored after each recomputation, so they are updated once per step.
Dropout draws the same mask when recomputed: the random state is saved with each layer's input
(``preserve_rng_state``) and restored for the recomputation.

Order with the other parallelisms (torchtitan's): pipeline split, then tensor parallelism, then this, then
FSDP2 (``fully_shard``), so each layer's recomputation runs between FSDP2's gather and free.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from lightning_parallel._compat import disable_current_modes
from lightning_parallel.parallel.pipeline.split import ElsewhereLayer
from lightning_parallel.protocol import has_pipeline_layers

AC_MODES = ("none", "full", "selective")


def _ops(*names: str) -> frozenset:
    """Op overloads by ``namespace.op.overload`` name; ones this torch build lacks are left out."""
    found = set()
    for name in names:
        namespace, op, overload = name.split(".")
        try:
            found.add(getattr(getattr(getattr(torch.ops, namespace), op), overload))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


# outputs kept by selective checkpointing: costly to recompute. Of the tensor-parallel collectives only the
# reduce-scatter (sequence parallelism), whose output is 1/tp of the activation, as torchtitan does; keeping
# the all-reduce and all-gather outputs (whole activations) would keep about as much as no checkpointing
SAVED_OPS = _ops(
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten.convolution.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "_c10d_functional.reduce_scatter_tensor.default",
)


def check_activation_checkpointing(mode: object, setting: str = "activation_checkpointing") -> str:
    """The mode ``none``, ``full`` or ``selective`` (``None`` means ``none``), or a ValueError naming ``setting``."""
    if mode is None:
        return "none"
    if not isinstance(mode, str) or mode not in AC_MODES:
        raise ValueError(f"{setting}={mode!r} is unknown: set it to one of {', '.join(AC_MODES)}.")
    return mode


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of :data:`SAVED_OPS`, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """Children of the outermost ModuleList/Sequential containers under ``module``."""
    blocks: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            blocks += list(child.children())
        else:
            blocks += _repeated_blocks(child)
    return blocks


def checkpoint_layers(model_or_layers: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    """The layers :func:`apply_activation_checkpointing` wraps (layers of other pipeline stages left out)."""
    if isinstance(model_or_layers, nn.Module):
        if has_pipeline_layers(model_or_layers):
            layers = list(model_or_layers.pipeline_layers())
        else:
            layers = _repeated_blocks(model_or_layers)
    else:
        layers = list(model_or_layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer {i} to checkpoint is a {type(layer).__name__}, not an nn.Module.")
    return [layer for layer in layers if not isinstance(layer, ElsewhereLayer)]


def apply_activation_checkpointing(
    model_or_layers: nn.Module | Iterable[nn.Module], mode: str, *, preserve_rng_state: bool = True
) -> list[nn.Module]:
    """Recompute the activations of each layer in backward instead of keeping them, in place.

    Args:
        model_or_layers: a model (its ``pipeline_layers()``, else its repeated blocks are checkpointed) or
            the layers themselves. Each layer is checkpointed on its own; do not pass nested layers.
        mode: ``"none"`` (nothing changes), ``"full"`` or ``"selective"``.
        preserve_rng_state: restore the random state for the recomputation, so dropout draws the same mask.

    Returns:
        The layers now checkpointed (module paths, parameter names and state_dict keys are unchanged).
    """
    mode = check_activation_checkpointing(mode)
    if mode == "none":
        return []
    layers = checkpoint_layers(model_or_layers)
    for layer in layers:
        current = layer.__dict__.get("forward")
        if isinstance(current, CheckpointedForward):
            if current.mode == mode:
                continue  # a model fitted again
            raise ValueError(
                f"{type(layer).__name__} is already checkpointed with mode {current.mode!r}, not {mode!r}: apply "
                "activation checkpointing once per model (the strategy's activation_checkpointing, or yourself)."
            )
        layer.forward = CheckpointedForward(layer, mode, preserve_rng_state, inner=current)
    return layers


def checkpointing_mode(module: nn.Module) -> str:
    """``"full"`` or ``"selective"`` when ``module`` is checkpointed, else ``"none"``."""
    current = module.__dict__.get("forward")
    return current.mode if isinstance(current, CheckpointedForward) else "none"


class CheckpointedForward:
    """Stands in for ``module.forward``: runs the module's own forward under ``torch.utils.checkpoint``.

    An object, not a closure, so a deep copy or a pickled copy of the module checkpoints itself.
    """

    def __init__(self, module: nn.Module, mode: str, preserve_rng_state: bool, inner: Any = None) -> None:
        self.module, self.mode, self.preserve_rng_state = module, mode, preserve_rng_state
        self.inner = inner  # a forward already set on the instance, else the class's

    def _forward(self) -> Any:
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._forward()
        if not torch.is_grad_enabled():  # evaluation: nothing would be kept for a backward anyway
            return forward(*args, **kwargs)
        runs = 0

        def run(*a: Any, **k: Any) -> Any:
            nonlocal runs
            runs += 1
            if runs == 1:
                return forward(*a, **k)
            with _buffers_restored(self.module):  # a recomputation must not update running statistics again
                return forward(*a, **k)

        context_fn = _selective_contexts if self.mode == "selective" else noop_context_fn
        return checkpoint(
            run,
            *args,
            use_reentrant=False,
            context_fn=context_fn,
            preserve_rng_state=self.preserve_rng_state,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"CheckpointedForward({type(self.module).__name__}, mode={self.mode!r})"


_selective_contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)


@contextlib.contextmanager
def _buffers_restored(module: nn.Module) -> Generator[None, None, None]:
    buffers = list(module.buffers())
    # outside the dispatch modes of selective checkpointing: it replays the forward's ops by count
    with disable_current_modes(), torch.no_grad():
        saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with disable_current_modes(), torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)
