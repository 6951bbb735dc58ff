"""Bytes of model states and of activations held by this rank, counted from the tensors themselves (so the
same on any device). Pure torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_parallel._compat import TorchDispatchMode, tree_leaves
from lightning_parallel.parallel.dtensor import local as _local


def _storage_bytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    # Views (ZeRO's flat buffers, FSDP's padded shards) share a storage: count each storage once.
    total = 0
    for t in tensors:
        t = _local(t)
        if _is_wrapper(t):  # a tensor subclass (torchao's float8 weight): the storages of the tensors it wraps
            names, _ = t.__tensor_flatten__()
            total += _storage_bytes([getattr(t, n) for n in names], seen)
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _is_wrapper(t: Tensor) -> bool:
    return type(t) not in (Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__")


def _plain(tensors: Iterable[Tensor]) -> list[Tensor]:
    """``tensors`` with wrapper subclasses (torchao's float8 weights; DTensors read locally) replaced by the tensors
    they wrap."""
    out: list[Tensor] = []
    for t in tensors:
        t = _local(t)
        if _is_wrapper(t):
            names, _ = t.__tensor_flatten__()
            out += _plain([getattr(t, n) for n in names])
        else:
            out.append(t)
    return out


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer state (after a step, before zero_grad).

    Parameters and gradients are read from the module and from every optimizer's own parameters, so the
    flat slices of ZeRO-1/2 and FSDP's DTensor shards are all seen; shared storages count once.
    """
    optimizers = list(optimizers)
    opt_params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    seen: set[int] = set()
    params = _storage_bytes([*module.parameters(), *opt_params], seen)
    grads = _storage_bytes([p.grad for p in [*module.parameters(), *opt_params] if p.grad is not None], seen)
    states = [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    optimizer = _storage_bytes([v for v in states if v.dim() > 0], seen)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


class ActivationMemory(TorchDispatchMode):
    """Bytes of the tensors a forward leaves alive for backward: activations, counted on any device.

    While the mode is active it notes the storage of every tensor an op creates (weakly: nothing is kept
    alive by it). :meth:`sample` adds up those storages still alive, other than ``exclude``'s parameters,
    buffers and gradients. Taken after a training forward, before backward, that is what autograd saved for
    backward (with activation checkpointing: each layer's input and what selective checkpointing keeps),
    plus the output itself. ``peak`` is the largest sample. (``torch.autograd.graph.saved_tensors_hooks`` would
    miss most of it: torch's checkpoint installs its own hooks inside each layer, and holds the layer inputs
    and the outputs selective checkpointing keeps outside any hook.)

    Args:
        exclude: the model, whose parameters (FSDP2 gathers them during forward) and gradients do not count.
    """

    def __init__(self, exclude: nn.Module | None = None) -> None:
        super().__init__()
        self.exclude = exclude
        self.peak = 0
        self._created: set[StorageWeakRef] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._note(t)
        return out

    def _note(self, t: Tensor) -> None:
        t = _local(t)
        if t.device.type == "meta":
            return
        try:
            storage = t.untyped_storage()
            storage.data_ptr()
        except RuntimeError:  # a wrapper subclass (an async collective's result): its inner tensor is noted
            return
        self._created.add(StorageWeakRef(storage))

    def _excluded(self) -> set[int]:
        if self.exclude is None:
            return set()
        tensors = [*self.exclude.parameters(), *self.exclude.buffers()]
        tensors += [p.grad for p in self.exclude.parameters() if p.grad is not None]
        return {_local(t).untyped_storage().data_ptr() for t in _plain(tensors)}

    def sample(self) -> int:
        """Bytes of storage created while active and alive now (each storage once); updates ``peak``."""
        self._created = {ref for ref in self._created if not ref.expired()}
        excluded, seen, total = self._excluded(), set(), 0
        for ref in self._created:
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:  # freed since (by another thread: a finished send, say)
                continue
            ptr = storage.data_ptr()
            if storage.nbytes() == 0 or ptr in excluded or ptr in seen:
                continue
            seen.add(ptr)
            total += storage.nbytes()
        self.peak = max(self.peak, total)
        return total


def measure_saved_activation_bytes(
    fn: Callable[..., Any], *args: Any, exclude: nn.Module | None = None, **kwargs: Any
) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` (a training forward, loss included) and count what it leaves for backward.

    Returns:
        ``fn``'s result and the bytes of the tensors created during the call and still alive after it
        (see :class:`ActivationMemory`; ``exclude``'s parameters and gradients do not count).
    """
    with ActivationMemory(exclude) as meter:
        out = fn(*args, **kwargs)
    return out, meter.sample()
