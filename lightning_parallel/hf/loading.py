"""A ``save_pretrained`` folder's weights loaded into a model split over any layout, without a full copy per rank.

The model is built with its parameters on the meta device (no memory; buffers such as rotary tables are real)
and split by the strategy first (pipeline stages, tensor-parallel shards, ZeRO-3 shards). Then each rank gives
the parameters it holds storage and reads, from the safetensors files, only their tensors (those of its stages)
and of each tensor only its slice (``safe_open(...).get_slice``), where the slice is one box of the whole tensor:
``Shard`` and ``Replicate`` placements, on one mesh axis or several. A placement that is not one box (the strided
shard of GPT-2's fused q/k/v under tp, or ZeRO-3's dp shard of a tensor-parallel row split) is read whole, one
tensor at a time, and this rank's part kept. Tied weights the folder stores once (GPT-2's head) are read under
the name the folder has.

Pure torch + safetensors; no process group (each rank reads for itself).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_parallel._compat import StridedShard, compute_local_shape_and_global_offset
from lightning_parallel.hf.moe_loading import converted_weights

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def safetensors_files(folder: str | Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, for a ``save_pretrained`` folder; None when it has none."""
    from safetensors import safe_open

    folder = Path(folder)
    if (folder / SAFE_INDEX).is_file():
        weight_map = json.loads((folder / SAFE_INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / SAFE_WEIGHTS).is_file():
        with safe_open(folder / SAFE_WEIGHTS, "pt") as f:
            return dict.fromkeys(f.keys(), folder / SAFE_WEIGHTS)
    return None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and keep real buffers (each parameter is
    moved as it is registered: at most one is ever allocated)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the name of the first parameter it is tied to (same tensor), for every later alias."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _tie_again(model: nn.Module, aliases: dict[str, str]) -> None:
    """``to_empty`` makes a new parameter per module: put each tied parameter back in its aliases' places."""
    for alias, first in aliases.items():
        owner, _, attr = alias.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = model.get_parameter(first)


def local_box(param: DTensor) -> tuple[slice, ...] | None:
    """The slice of the whole tensor this rank holds of ``param``, or None when it is not one box."""
    if not all(isinstance(p, (Shard, Replicate)) and not isinstance(p, StridedShard) for p in param.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


class WeightReader:
    """Reads tensors and slices of them from a folder's safetensors files, counting the bytes read."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files, self.bytes_read = files, 0
        self._open: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _file(self, name: str):
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(path, "pt"))
        return self._open[path]

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> Tensor:
        """The tensor ``name``, or its ``box`` (no box, or the empty one of a 0-d tensor: all of it)."""
        f = self._file(name)
        value = f.get_slice(name)[box] if box else f.get_tensor(name)
        self.bytes_read += value.numel() * value.element_size()
        return value


def module_expert_ranges(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name -> ``(first, last)`` for the parameters of every module with an ``expert_range`` attribute
    (the hook an expert-parallel split sets on a Hugging Face experts module it cut: each of its parameters holds
    experts first..last-1 of the folder's on dim 0)."""
    return {
        f"{path}.{name}": tuple(module.expert_range)
        for path, module in model.named_modules()
        if getattr(module, "expert_range", None) is not None
        for name, _ in module.named_parameters(recurse=False)
    }


def load_local_weights(
    model: nn.Module,
    folder: str | Path,
    device: torch.device,
    aliases: dict[str, str],
    expert_ranges: Mapping[str, tuple[int, int]] | None = None,
) -> int:
    """Give ``model``'s meta parameters storage on ``device`` and this rank's part of the folder's weights.

    Parameters the folder stores under other names (a Mixture-of-Experts model's experts, saved one matrix per
    expert) are read through transformers' own conversions (:mod:`lightning_parallel.hf.moe_loading`); of those
    that stack experts on dim 0 only the experts this rank holds are read.

    Args:
        model: the HF model, split or not (parameters may be DTensors; placeholders hold none).
        folder: a ``save_pretrained`` folder with safetensors weights.
        device: where the parameters live.
        aliases: :func:`tied_aliases` of the model as built (before a pipeline split cut the ties).
        expert_ranges: parameter name -> the experts ``(first, last)`` (last excluded) a plain tensor holds, its
            dim 0 being those experts of the folder's (an expert-parallel split that keeps plain tensors); a
            DTensor says what it holds itself. Default: :func:`module_expert_ranges` (modules that say it).

    Returns:
        the bytes read from the files.

    Raises:
        ValueError: a parameter the folder does not hold (naming it); ``expert_ranges`` naming a DTensor.
    """
    files = safetensors_files(folder)
    if files is None:
        raise FileNotFoundError(f"{folder}: no {SAFE_WEIGHTS} or {SAFE_INDEX}: save the model with safetensors.")
    ranges = _checked_ranges(model, expert_ranges)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    tied = tied_aliases(model)  # the ties as they are now (a pipeline split may have cut some)
    model.to_empty(device=device)
    _tie_again(model, tied)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
    params = dict(model.named_parameters())
    renamed = [n for n in params if n not in files and aliases.get(n, n) not in files]
    converted = converted_weights(model, files, renamed)
    with WeightReader(files) as reader, torch.no_grad():
        for name, param in params.items():
            key = name if name in files else aliases.get(name, name)
            if key not in files and name not in converted:
                raise ValueError(
                    f"{folder} holds no weights for {name!r}: is it a save_pretrained folder of this model's class?"
                )
            target = param.to_local() if isinstance(param, DTensor) else param
            if target.numel() == 0:
                continue
            rows = ranges.get(name)
            box = (slice(*rows),) if rows is not None else local_box(param) if isinstance(param, DTensor) else None
            if key in files:
                value = _read_box(lambda box, key=key: reader.read(key, box), param, box, device)
            else:
                read = functools.partial(converted[name].read_box, name, model, reader.read)
                value = _read_box(read, param, box, device)
            target.copy_(value.reshape(target.shape))
        for name, buffer in model.named_buffers():  # persistent buffers the folder has (whole: small)
            if name in files:
                buffer.copy_(reader.read(name))
        return reader.bytes_read


def _checked_ranges(model: nn.Module, given: Mapping[str, tuple[int, int]] | None) -> dict[str, tuple[int, int]]:
    ranges = dict(module_expert_ranges(model) if given is None else given)
    held_whole = [n for n, p in model.named_parameters() if n in ranges and isinstance(p, DTensor)]
    if held_whole:
        raise ValueError(
            f"expert_ranges names {held_whole[0]!r}, a DTensor: its placements say which experts this rank holds. "
            "Give expert_ranges for plain tensors only."
        )
    return ranges


def _read_box(read: Callable, param: Tensor, box: tuple[slice, ...] | None, device: torch.device) -> Tensor:
    """This rank's part of ``param``: ``read(box)`` (``read(None)``: the whole tensor); a DTensor whose part is not
    one box is read whole and its part kept."""
    if box is not None or not isinstance(param, DTensor):
        return read(box)
    whole = read(None).to(device)
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
