"""Model and optimizer states as sharded, layout-independent dicts for torch's distributed checkpoint.
Pure torch.

Every tensor is keyed by the parameter's name in the single-process model and has its single-process
(global) shape; each rank contributes the pieces it holds: DTensor shards (tensor parallelism, FSDP2),
whole tensors (replicated: DCP writes one copy), and ranges of ZeRO-1/2 flat buffers
(:class:`~lightning_parallel.parallel.checkpoint.chunks.ChunkedTensor`). Loading builds the same dict
for the current layout, pointing at the live (or freshly allocated) storage, so DCP reads each rank's
pieces in place, whatever layout wrote them.

Keys (``P`` = ``optimizer_states.<i>.``)::

    state_dict.<name>                 model parameters and buffers
    P state.<name>.<key>              per-parameter optimizer state (exp_avg, step, momentum_buffer, ...)
    P order.<name>                    int64 [param group, position in the single-process model]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel._compat import compute_local_shape_and_global_offset
from lightning_parallel.parallel.checkpoint.chunks import chunked_view
from lightning_parallel.parallel.data.flat_group import SCALAR_STATE_KEYS
from lightning_parallel.parallel.data.sharding import FlatSlice, StateView
from lightning_parallel.parallel.dtensor import local as _local

MODEL = "state_dict."


def optimizer_prefix(index: int) -> str:
    return f"optimizer_states.{index}."


def param_names(module: nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter (tied parameters have several), in the module's order."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def model_state(module: nn.Module) -> dict[str, Tensor]:
    """The model's own (possibly sharded) tensors under ``state_dict.<name>``: no copies, no gathering."""
    return {MODEL + k: v for k, v in module.state_dict().items() if torch.is_tensor(v)}


def _local_offsets(p: Tensor) -> tuple[int, ...]:
    if isinstance(p, DTensor):
        _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offsets)
    return (0,) * p.dim()


def _local_shape(p: Tensor) -> tuple[int, ...]:
    return tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)


def _flat_pieces(piece: FlatSlice, buffer: Tensor) -> Iterable[tuple[nn.Parameter, Tensor]]:
    """(parameter, its elements in this rank's slice ``buffer`` of a flat buffer, as a ChunkedTensor)."""
    start, end = piece.start, piece.end
    for p, off in zip(piece.params, piece.offsets):
        lo, hi = max(start, off), min(end, off + _local(p).numel())
        if lo < hi:
            view = buffer[lo - start : hi - start]
            yield p, chunked_view(view, lo - off, _local_shape(p), _local_offsets(p), tuple(p.shape))


def optimizer_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    index: int,
    full_order: list[str],
    view: StateView | None = None,
) -> dict[str, Any]:
    """One optimizer's per-parameter state under ``optimizer_states.<index>.``, sharded as it is held.

    Args:
        module: the model the optimizer trains (its parameter names are the keys).
        optimizer: the optimizer (for ZeRO-1/2: the one stepping the flat slices).
        index: the optimizer's position in ``configure_optimizers``.
        full_order: the single-process model's parameter names in ``named_parameters()`` order: the
            position of each parameter, so a single-process optimizer's index numbering can be rebuilt.
        view: the sharding's view of the state when it lives in flat slices (``sharding.state_view``).
    """
    prefix, names, position = optimizer_prefix(index), param_names(module), {n: i for i, n in enumerate(full_order)}
    out: dict[str, Any] = {}
    groups = view.param_groups if view is not None else [g["params"] for g in optimizer.param_groups]
    for g, params in enumerate(groups):
        for p in params:
            for name in names.get(id(p), []):
                if name in position:
                    out[f"{prefix}order.{name}"] = torch.tensor([g, position[name]], dtype=torch.int64)
    if view is None:
        for p, state in optimizer.state.items():
            for name in names.get(id(p), []):
                out.update({f"{prefix}state.{name}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
        return out
    for piece in (piece for pieces in view.slices for piece in pieces):
        for key, value in optimizer.state.get(piece.key, {}).items():
            if not torch.is_tensor(value):
                continue
            if key in SCALAR_STATE_KEYS:
                parts: Iterable[tuple[nn.Parameter, Tensor]] = ((p, value) for p in piece.params)
            else:
                parts = _flat_pieces(piece, value)
            for p, part in parts:
                out.update({f"{prefix}state.{name}.{key}": part for name in names[id(p)]})
    return out


def _saved_state_keys(saved: dict[str, Any], prefix: str, name: str) -> list[str]:
    """The optimizer-state keys (``exp_avg``, ...) saved for parameter ``name``."""
    head = f"{prefix}state.{name}."
    return [k[len(head) :] for k in saved if k.startswith(head) and "." not in k[len(head) :]]


def _saved_name(saved: dict[str, Any], prefix: str, names: list[str]) -> str | None:
    """The first of a parameter's names the checkpoint has state for (tied copies may be saved under either)."""
    return next((n for n in names if _saved_state_keys(saved, prefix, n)), None)


def optimizer_load_targets(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    index: int,
    saved: dict[str, Any],
    view: StateView | None = None,
) -> tuple[dict[str, Any], dict[Tensor, dict[str, Tensor]]]:
    """Fresh optimizer-state tensors shaped for this rank's layout, for DCP to fill from a checkpoint.

    Args:
        saved: the checkpoint's tensors (name -> metadata with ``size`` and ``properties.dtype``).

    Returns:
        ``(targets, states)``: the dict to pass to the load, and the per-parameter states to install into
        ``optimizer.state`` once it is filled (:func:`install_optimizer_state`).
    """
    prefix, names = optimizer_prefix(index), param_names(module)
    targets: dict[str, Any] = {}
    states: dict[Tensor, dict[str, Tensor]] = {}

    def dtype(key: str) -> torch.dtype:
        return saved[key].properties.dtype

    if view is None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = _saved_name(saved, prefix, names.get(id(p), []))
                if name is None:
                    continue  # no state saved for it (never stepped, or a stateless optimizer)
                state = {}
                for key in _saved_state_keys(saved, prefix, name):
                    full_key = f"{prefix}state.{name}.{key}"
                    if key in SCALAR_STATE_KEYS or tuple(saved[full_key].size) != tuple(p.shape):
                        state[key] = torch.empty(tuple(saved[full_key].size), dtype=dtype(full_key))
                    else:
                        state[key] = torch.empty_like(p, dtype=dtype(full_key), requires_grad=False)
                    targets[full_key] = state[key]
                states[p] = state
        return targets, states
    for piece in (piece for pieces in view.slices for piece in pieces):
        chosen = [(p, _saved_name(saved, prefix, names[id(p)])) for p in piece.params]
        if any(name is None for _, name in chosen):
            continue
        p0, name0 = chosen[0]
        state = {}
        for key in _saved_state_keys(saved, prefix, name0):
            first_key = f"{prefix}state.{name0}.{key}"
            if key in SCALAR_STATE_KEYS:
                state[key] = targets[first_key] = torch.empty(tuple(saved[first_key].size), dtype=dtype(first_key))
                continue
            # zeros: the buffer's padding belongs to no parameter and is never read back
            state[key] = torch.zeros_like(piece.key, dtype=dtype(first_key))
            by_param = dict(chosen)
            for p, part in _flat_pieces(piece, state[key]):
                targets[f"{prefix}state.{by_param[p]}.{key}"] = part
        states[piece.key] = state
    return targets, states


def install_optimizer_state(optimizer: torch.optim.Optimizer, states: dict[Tensor, dict[str, Tensor]]) -> None:
    """Hand loaded states to the optimizer, on each parameter's device."""
    for p, state in states.items():
        device = (p.to_local() if isinstance(p, DTensor) else p).device
        optimizer.state[p] = {
            k: v if (k in SCALAR_STATE_KEYS or isinstance(v, DTensor)) else v.to(device) for k, v in state.items()
        }


def full_order_checkpoint(tensors: dict[str, Tensor], param_groups: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """A sharded checkpoint's tensors, loaded whole, in the single-process format Lightning writes:
    ``state_dict`` by name, ``optimizer_states`` keyed by parameter index like ``Optimizer.state_dict()``.

    Args:
        tensors: every saved tensor, whole (see ``checkpoint_io.full_tensors``).
        param_groups: each optimizer's param-group hyperparameters (without ``params``), as saved.
    """
    model = {k[len(MODEL) :]: v for k, v in tensors.items() if k.startswith(MODEL)}
    optimizers = []
    for index, groups in enumerate(param_groups):
        prefix = optimizer_prefix(index)
        order = sorted(
            (int(v[0]), int(v[1]), k[len(prefix + "order.") :])
            for k, v in tensors.items()
            if k.startswith(prefix + "order.")
        )
        state, out_groups, next_index = {}, [], 0
        for g, hyper in enumerate(groups):
            members = [name for group, _, name in order if group == g]
            ids = list(range(next_index, next_index + len(members)))
            next_index += len(members)
            out_groups.append({**hyper, "params": ids})
            for i, name in zip(ids, members):
                keys = _saved_state_keys(tensors, prefix, name)
                if keys:
                    state[i] = {key: tensors[f"{prefix}state.{name}.{key}"] for key in keys}
        optimizers.append({"state": state, "param_groups": out_groups})
    return {"state_dict": model, "optimizer_states": optimizers}
