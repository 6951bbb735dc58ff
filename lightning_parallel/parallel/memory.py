"""Bytes of model states held by this rank, counted from the tensors themselves. Pure torch."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage_bytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    # Views (ZeRO's flat buffers, FSDP's padded shards) share a storage: count each storage once.
    total = 0
    for t in tensors:
        t = _local(t)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


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


def zero_formula_bytes(stage: int, num_params: int, world: int) -> int:
    """Model-state bytes per rank for fp32 Adam under ZeRO (Rajbhandari et al., 2020), K=8 state bytes."""
    p, n = num_params, world
    return {0: 16 * p, 1: 8 * p + 8 * p // n, 2: 4 * p + 12 * p // n, 3: 16 * p // n}[stage]
