"""A model split while on the meta device, then given storage and values: each rank only what it holds. Pure torch.

Under a layout that shards parameters (tp > 1, ZeRO-3, and their compositions with pp), no rank holds a whole
copy of the model at any time. :func:`~lightning_parallel.parallel.parallelize.parallelize` splits the model while
its tensors are on the meta device, then :func:`fill_meta_tensors` allocates each rank's pieces (tensor-parallel
and FSDP2 shards, this rank's pipeline stages) and fills them from one of two sources, so that every rank holds
exactly the values a single process has:

- **values set aside** (:func:`set_aside`): a model built on the host as usual (``model = MyModule()``) has its
  tensors taken out by name and its modules moved to the meta device before the split; afterwards each rank copies
  its slice of every tensor from that host copy (only the slice reaches the accelerator), and the host copy is
  dropped. The host held the whole model already: nothing new is ever whole.
- **reset units**: tensors *built* on the meta device (in ``configure_model``, or under ``Trainer.init_module()``)
  get the module's own ``reset_parameters()``, one unit at a time (the pipeline layers, else each tensor's owner:
  :func:`lightning_parallel.protocol.reset_units`). The unit's tensors are swapped for whole host tensors, its
  ``reset_parameters()`` fills them, each rank keeps its slice, and the unit's host tensors are freed before the
  next unit: the largest transient is one unit (one layer), never the model (a unit holding other units, such as
  LitGPT's GPT owning its rotary tables, stands in for its own tensors only). The CPU generator is first set to its
  state when the model was built (``rng_state``), so draws from the global generator replay in the order a single
  process made them (``nn.Linear``'s own init), and values equal a single process that built the model on the host.

Why whole host tensors per unit and not DTensor's random ops on the shards: torch 2.13's ``OffsetBasedRNGTracker``
refuses CPU meshes, and on CUDA its Philox offsets give a shard other numbers than one device draws for the whole
tensor (``Shard(1)`` slices are not even contiguous runs of the stream); the recipe models draw from their own host
generators (``models/gpt.py``). A CPU generator (MT19937) cannot skip ahead, so each drawn tensor is drawn whole.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_parallel._compat import StridedShard, compute_local_shape_and_global_offset
from lightning_parallel.protocol import reset_units, unfilled_error


def splits_parameters(config: Any) -> bool:
    """Whether a layout shards parameters beyond whole pipeline stages (tp or ZeRO-3): then the model is split on the
    meta device and materialized after, so no rank ever holds a whole copy."""
    return config.tp > 1 or config.zero_stage == 3


def splits_model(config: Any) -> bool:
    """Whether a layout keeps a part of the model on each rank (pp, tp or ZeRO-3): then the model is not moved to
    the device whole, and ``configure_model`` / ``Trainer.init_module()`` build it on the meta device."""
    return config.pp > 1 or splits_parameters(config)


def named_tensors(root: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every parameter and buffer of ``root`` under every name it has (tied weights under each of theirs)."""
    yield from root.named_parameters(remove_duplicate=False)
    yield from root.named_buffers(remove_duplicate=False)


def _owned(module: nn.Module) -> list[Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def set_aside(root: nn.Module) -> dict[str, Tensor]:
    """Take ``root``'s real tensors out, by every name, and leave their modules on the meta device (in place).

    Returns:
        name -> the tensor as built (its storage, no copy); :func:`fill_meta_tensors` copies each rank's slices.
    """
    values = {name: t.detach() for name, t in named_tensors(root) if not t.is_meta}
    ties = _ties(root)
    for module in root.modules():  # only modules that own real tensors: torchmetrics states are left alone
        if any(not t.is_meta for t in _owned(module)):
            module.to_empty(device="meta", recurse=False)
    _tie_again(root, ties)
    return values


def _ties(root: nn.Module) -> list[tuple[str, str]]:
    """(a later name, the first name) of every parameter that has several names (a tied weight)."""
    first: dict[int, str] = {}
    return [(name, first.setdefault(id(p), name)) for name, p in root.named_parameters(remove_duplicate=False)]


def _tie_again(root: nn.Module, ties: list[tuple[str, str]]) -> None:
    """Moving a plain parameter between devices that share no tensor type (host and meta) makes a new Parameter per
    module: put the first one back in its other places, so a tied weight stays one parameter."""
    for alias, first in ties:
        if alias != first:
            owner, _, attr = alias.rpartition(".")
            root.get_submodule(owner)._parameters[attr] = root.get_parameter(first)


def move_real(root: nn.Module, device: torch.device) -> None:
    """Move ``root``'s real tensors to ``device`` in place (meta ones stay: the module's materialize fills them)."""

    def moved(t: Tensor) -> Tensor:
        return t if t.is_meta else t.to(device)

    for module in root.modules():
        if any(not t.is_meta and t.device != device for t in _owned(module)):
            module._apply(moved, recurse=False)


def allocate(root: nn.Module, device: torch.device, params_device: torch.device) -> None:
    """Storage for every meta tensor (uninitialized): parameters on ``params_device``, buffers on ``device``.

    Innermost modules first, so a ZeRO-3 unit (FSDP2's ``_apply``) re-pads shards its children already hold; only
    modules that own meta tensors, so torchmetrics states and tensors filled already stay as they are."""

    def empty(t: Tensor) -> Tensor:
        return torch.empty_like(t, device=params_device if isinstance(t, nn.Parameter) else device)

    ties = _ties(root)
    for module in reversed(list(root.modules())):
        if any(t.is_meta for t in _owned(module)):
            module._apply(empty, recurse=False)
    _tie_again(root, ties)


def _is_box(param: DTensor) -> bool:
    """Whether this rank's piece is one box of the whole tensor (FSDP2 over a tensor-parallel dim is: its
    ``_StridedShard`` splits the tp shard again; a fused q/k/v split is not)."""
    mesh, placements = param.device_mesh, param.placements
    for i, p in enumerate(placements):
        if isinstance(p, StridedShard):
            later = [
                mesh.size(j) for j, q in enumerate(placements) if j > i and isinstance(q, Shard) and q.dim == p.dim
            ]
            if p.split_factor != math.prod(later):
                return False
        elif not isinstance(p, (Shard, Replicate)):
            return False
    return True


def local_piece(full: Tensor, like: Tensor) -> Tensor:
    """The part of the whole tensor ``full`` that this rank holds of ``like`` (all of it for a plain tensor)."""
    if not isinstance(like, DTensor):
        return full
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} cannot fill one of shape {tuple(like.shape)}")
    if _is_box(like):
        shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
        return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    # not one box: DTensor's own split (it moves the one tensor to the mesh's device first)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


@torch.no_grad()
def _fill(dest: Tensor, full: Tensor) -> None:
    target = dest.to_local() if isinstance(dest, DTensor) else dest  # no grad: the local tensor itself
    target.copy_(local_piece(full, dest))


def fill_meta_tensors(
    module: object,
    root: nn.Module,
    device: torch.device,
    values: dict[str, Tensor] | None = None,
    *,
    params_device: torch.device | None = None,
    rng_state: Tensor | None = None,
    init: Callable[[nn.Module], None] | None = None,
) -> list[str]:
    """Allocate ``root``'s meta tensors (this rank's pieces) and fill them: from ``values`` where set aside, else
    by the reset units' ``reset_parameters()`` (see the module docstring). Runs after a module's own
    ``materialize(device)``: the tensors set aside are filled wherever they are by then.

    Args:
        module: the object with the protocol methods (its ``pipeline_layers()`` are the reset units).
        root: the split model.
        device: where buffers (and parameters, unless ``params_device``) live.
        values: :func:`set_aside`'s tensors by name.
        params_device: where parameters live (the host when ZeRO-3 offloads them).
        rng_state: the CPU generator's state when the model was built on meta; set before the first reset.
        init: initializes the tensors one module owns (a :class:`SeededInit`): then every module owning a tensor
            left on meta is a unit, ``init(module)`` runs instead of ``reset_parameters()``, and only the module's
            own tensors are stood in for.

    Returns:
        the paths of the units reset, in order.

    Raises:
        TypeError: a tensor built on meta that no ``reset_parameters()`` fills (naming it and the fix).
    """
    values = values or {}
    meta = {name for name, t in named_tensors(root) if t.is_meta}
    if not meta and not values:
        return []
    allocate(root, device, params_device or device)
    tensors = dict(named_tensors(root))
    # every tensor set aside, also one a module's own materialize(device) gave storage (HFCausalLM's buffers)
    for name in sorted(values.keys() & tensors.keys()):
        _fill(tensors[name], values[name])
    pending = meta - values.keys()
    units = owner_units(root, pending) if init is not None else reset_units(module, root, pending)
    if units and rng_state is not None and init is None:
        torch.random.set_rng_state(rng_state)  # global draws replay as when the model was built
    drawn = set(pending)
    own = _assigned([path for path, _ in units], pending)
    for path, unit in units:
        pending -= _reset_unit(path, unit, own.get(path, set()), drawn, init)
    filled = {id(tensors[name]) for name in drawn - pending}
    pending = {name for name in pending if id(tensors[name]) not in filled}  # a tied weight filled under its other name
    if pending:
        raise unfilled_error(module, root, sorted(pending))
    return [path for path, _ in units]


def owner_units(root: nn.Module, names: set[str]) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module of ``root`` that owns one of the tensors ``names``, in ``root``'s order."""
    owners = {name.rpartition(".")[0] for name in names}
    return [(path, m) for path, m in root.named_modules(remove_duplicate=False) if path in owners]


def _assigned(paths: list[str], names: set[str]) -> dict[str, set[str]]:
    """Unit path -> the tensors it initializes: each name goes to the innermost unit holding it. A unit holding other
    units (LitGPT's GPT, which owns the rotary tables) stands in for its own tensors only, never for the whole model;
    what its ``reset_parameters()`` writes into an inner unit's tensors lands in the real ones (filled already)."""
    own: dict[str, set[str]] = {}
    for name in names:
        holders = [p for p in paths if p == "" or name.startswith(p + ".")]
        own.setdefault(max(holders, key=len), set()).add(name)
    return own


def _slots(path: str, unit: nn.Module, names: set[str], other: bool = False) -> Iterator[tuple[dict, str, str]]:
    """(the owning dict, the key, the full name) of every tensor slot in ``unit`` named in ``names`` (``other``: of
    those not named, that are DTensors)."""
    for sub, module in unit.named_modules(remove_duplicate=False):
        prefix = ".".join(p for p in (path, sub) if p)
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                full = f"{prefix}.{key}" if prefix else key
                if t is not None and (full not in names and isinstance(t, DTensor) if other else full in names):
                    yield table, key, full


def _blank(t: Tensor) -> Tensor:
    """A whole host tensor shaped like ``t``, NaN (or the lowest integer) where nothing has written yet."""
    shadow = torch.empty(t.shape, dtype=t.dtype)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return shadow.fill_(float("nan"))
    return shadow.fill_(torch.iinfo(t.dtype).min) if t.dtype != torch.bool else shadow.zero_()


@torch.no_grad()
def _reset_unit(
    path: str, unit: nn.Module, own: set[str], drawn: set[str], init: Callable[[nn.Module], None] | None = None
) -> set[str]:
    """Run ``unit.reset_parameters()`` (or ``init(unit)``) on whole host stand-ins for its tensors ``own``; copy each
    rank's slices of those it filled (of ``drawn``: not set aside) into the real tensors; return the names it filled.

    Raises:
        TypeError: the reset wrote into an inner unit's split tensor (this rank's piece of it, not the whole).
    """
    split = {name: (table[key], table[key]._version) for table, key, name in _slots(path, unit, own, other=True)}
    slots = list(_slots(path, unit, own))
    originals = [table[key] for table, key, _ in slots]
    stand_in: dict[int, Tensor] = {}  # one stand-in per tensor: weights tied inside the unit stay tied
    for (table, key, _), t in zip(slots, originals):
        if id(t) not in stand_in:
            blank = _blank(t)
            stand_in[id(t)] = nn.Parameter(blank, t.requires_grad) if isinstance(t, nn.Parameter) else blank
        table[key] = stand_in[id(t)]
    versions = {i: s._version for i, s in stand_in.items()}
    try:
        if init is None:
            unit.reset_parameters()
        else:
            init(unit)
        filled = {}
        for (table, key, name), t in zip(slots, originals):
            now = table[key]
            if name in drawn and _was_written(now, stand_in[id(t)], versions[id(t)]):
                filled[name] = (t, now)
    finally:
        for (table, key, _), t in zip(slots, originals):
            table[key] = t
    for t, now in filled.values():
        _fill(t, now)
    written = [name for name, (t, version) in split.items() if t._version != version]
    if written:
        raise TypeError(
            f"the reset_parameters() of {path or 'the root'} ({type(unit).__name__}) writes {written[:3]}, which a "
            "unit inside it initialized, and this rank holds only a piece of them: initialize each module's own "
            "tensors in its own reset_parameters()."
        )
    return set(filled)


_PIECE = 2**20  # elements of a stand-in checked at once


def _was_written(now: Tensor, blank: Tensor, version: int) -> bool:
    if now is not blank:  # reset_parameters() assigned a new tensor
        return True
    if blank.dtype.is_floating_point or blank.dtype.is_complex:
        flat = blank.reshape(-1)  # looked at in pieces: a whole boolean mask would add a quarter of an fp32 tensor
        return not any(bool(torch.isnan(flat[i : i + _PIECE]).any()) for i in range(0, flat.numel(), _PIECE))
    if blank.dtype == torch.bool:
        return blank._version != version
    return blank._version != version or bool((blank != torch.iinfo(blank.dtype).min).any())


def unit_seed(seed: int, path: str) -> int:
    """The seed of the module at ``path`` (its name in the model) of a model seeded with ``seed``: stable across
    processes and Python runs (CRC-32 of the name, not ``hash``)."""
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % 2**63


class SeededInit:
    """Initializes one module of ``model`` (built on meta) as ``init(module)`` does, the global generator seeded by
    :func:`unit_seed` of ``seed`` and the module's name in ``model``, and restored afterwards; for
    :func:`fill_meta_tensors`' ``init``. A module outside ``model`` is left to its ``reset_parameters()``.

    Args:
        model: the model as built (names are taken now: a later split or wrapper changes nothing).
        init: what initializes the tensors a module owns (Hugging Face's ``_init_weights``, LitGPT's
            ``reset_parameters()``).
        seed: the model's seed; default: the global generator's (``torch.initial_seed()``, which
            ``seed_everything`` sets), taken now.
    """

    def __init__(self, model: nn.Module, init: Callable[[nn.Module], None], seed: int | None = None) -> None:
        self.model = model
        self.paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
        self.modules = list(model.modules())  # kept alive (a pipeline split drops other stages'): ids stay theirs
        self.init, self.seed = init, torch.initial_seed() if seed is None else seed
        # a tied weight's later places: (module id) -> [(its key there, the first owner, the key in the owner)]
        self.ties: dict[int, list[tuple[str, nn.Module, str]]] = {}
        for alias, first in _ties(model):
            if alias != first:
                module, key = model.get_submodule(alias.rpartition(".")[0]), alias.rpartition(".")[2]
                owner = model.get_submodule(first.rpartition(".")[0])
                self.ties.setdefault(id(module), []).append((key, owner, first.rpartition(".")[2]))

    def _seeded(self, module: nn.Module) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(self.seed, self.paths[id(module)]))
            self.init(module)

    @torch.no_grad()
    def __call__(self, module: nn.Module) -> None:
        if id(module) not in self.paths:  # swapped in since (fp8's Float8Linear): the module now at its path
            for path, m in self.model.named_modules(remove_duplicate=False):
                if id(m) not in self.paths:
                    self.paths[id(m)] = path
                    self.modules.append(m)
        if id(module) not in self.paths:
            module.reset_parameters()
            return
        self._seeded(module)
        for key, owner, owner_key in self.ties.get(id(module), []):  # the first owner's values, also in another stage
            module._parameters[key].copy_(self._owner_value(owner, owner_key))

    def _owner_value(self, owner: nn.Module, key: str) -> Tensor:
        """What ``owner`` initializes its ``key`` to, on whole host stand-ins for its own parameters."""
        kept = dict(owner._parameters)
        try:
            for name, t in kept.items():
                if t is not None:
                    owner._parameters[name] = nn.Parameter(_blank(t), t.requires_grad)
            self._seeded(owner)
            return owner._parameters[key].detach()
        finally:
            owner._parameters.update(kept)
