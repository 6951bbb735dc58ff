"""ZeRO stage 3 with torch's FSDP2 (``fully_shard``): which modules become sharding units, and applying it.

A unit all-gathers its parameters just before its forward and frees them after, so a unit must own
every parameter its forward uses, and each parameter must belong to exactly one unit. The unit choice is
a pure function so it can be tested without a process group.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_parallel._compat import StridedShard
from lightning_parallel.parallel.data.sharding import DataParallelSharding, register_sharding
from lightning_parallel.parallel.expert.apply import is_expert_param

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _block_units(module: nn.Module, prefix: str) -> list[str]:
    """Every child of the outermost ModuleList/Sequential containers: the repeated blocks."""
    units = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, _CONTAINERS):
            units += [f"{path}.{n}" for n, c in child.named_children() if _has_params(c)]
        else:
            units += _block_units(child, f"{path}.")
    return units


def _owned_params(root: nn.Module, path: str, units: set[str]) -> set[int]:
    """Ids of parameters under ``path`` that no nested unit owns."""
    module = root.get_submodule(path)
    nested = [u for u in units if u != path and (path == "" or u.startswith(path + "."))]
    inner = {id(p) for u in nested for p in root.get_submodule(u).parameters()}
    return {id(p) for p in module.parameters()} - inner


def _common_ancestor(a: str, b: str) -> str:
    parts = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts)


def fsdp_units(root: nn.Module) -> list[str]:
    """Module paths to shard as units, innermost first; ``""`` is the root itself.

    Units are the repeated blocks, then every top-level child with parameters left over (a ModuleDict's
    children in its place), then the root
    when parameters remain directly on it. Two units that share a parameter (tied embedding and head)
    are replaced by their closest common ancestor, so the shared weight is gathered once.
    """
    units = set(_block_units(root, ""))
    for name, child in root.named_children():
        # a ModuleDict has no forward for FSDP2 to hook (LitGPT's ``transformer``): its children are the units
        inner = [f"{name}.{n}" for n, _ in child.named_children()] if isinstance(child, nn.ModuleDict) else [name]
        units |= {path for path in inner if _owned_params(root, path, units)}
    changed = True
    while changed:
        changed = False
        owners: dict[int, str] = {}
        for unit in sorted(units, key=lambda u: -u.count(".")):
            for pid in _owned_params(root, unit, units):
                other = owners.setdefault(pid, unit)
                if other != unit:
                    ancestor = _common_ancestor(other, unit)
                    units = {u for u in units if u not in (other, unit)} | {ancestor}
                    changed = True
                    break
            if changed:
                break
    if "" not in units and (_owned_params(root, "", units) or (units and not _one_enclosing_unit(units))):
        # one unit must enclose the rest: FSDP2 makes every unit with no unit above it a root of its own, and a
        # root keeps its parameters gathered from forward to backward (reshard_after_forward=None), which would
        # hold every block of a model without one (blocks plus loose top-level layers) unsharded through the step
        units.add("")
    return sorted(units, key=lambda u: (-u.count(".") if u else 1, u))


def _one_enclosing_unit(units: set[str]) -> bool:
    """Whether one of ``units`` holds all the others (FSDP2's root, whose lazy init sets up all of them)."""
    return any(all(u == top or u.startswith(top + ".") for u in units) for top in units)


# MoE routers, by name: a module called so whose parent also holds the experts (``experts``). The recipe's MoE
# (``router``, computed in fp32 also under autocast) and transformers' MoE blocks (``gate``: Mixtral, Qwen2/3-MoE,
# OLMoE, DeepSeek-V3 routers). Kept in fp32 when ZeRO-3 gathers the rest in bf16 (:func:`router_units`).
ROUTER_NAMES = ("router", "gate")


def router_units(root: nn.Module) -> list[str]:
    """Paths of the MoE routers in ``root`` (:data:`ROUTER_NAMES` beside an ``experts`` child, holding parameters).

    Under ``param_dtype=bf16`` each becomes a ZeRO-3 unit of its own gathered in fp32: a router picks experts by
    comparing logits, where bf16's 8-bit mantissa flips near ties (Switch Transformer's selective precision).
    """
    found = []
    for name, module in root.named_modules():
        children = dict(module.named_children())
        if "experts" not in children:
            continue
        prefix = f"{name}." if name else ""
        found += [prefix + n for n in ROUTER_NAMES if n in children and _has_params(children[n])]
    return found


def apply_fsdp(
    root: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    offload: bool = False,
    units: list[str] | None = None,
    reduce_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
    full_precision: tuple[str, ...] = (),
) -> list[str]:
    """Shard ``root``'s parameters, gradients and optimizer state over ``mesh`` (ZeRO-3) in place.

    Args:
        reduce_dtype: the dtype gradients are reduced in (None: the parameters' own, or ``param_dtype``'s).
        param_dtype: the dtype parameters are gathered in and computed with (FSDP2's ``MixedPrecisionPolicy``;
            None: their own). The sharded fp32 parameters, their gradients and the optimizer stay as they are.
        full_precision: units gathered in their own dtype whatever ``param_dtype`` says (MoE routers).

    Returns:
        The unit paths, innermost first (``""`` when the root itself became a unit).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    units = fsdp_units(root) if units is None else units
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    for path in units:
        # the root is gathered for the whole step anyway: freeing it after forward would only regather it.
        # None is torch's own default: every unit reshards except whichever becomes the FSDP root at the first
        # forward (the outermost unit), which saves one all-gather of it per step
        reshard = False if path == "" or not reshard_after_forward else None
        fully_shard(
            root.get_submodule(path),
            mesh=mesh,
            reshard_after_forward=reshard,
            offload_policy=policy,
            mp_policy=precision_policy(None if path in full_precision else param_dtype, reduce_dtype),
            shard_placement_fn=shard_dim_of,
        )
    set_prefetch(root, units)
    return units


def precision_policy(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy``: parameters gathered in ``param_dtype``, gradients reduced in ``reduce_dtype``
    (gradient compression's wire dtype), else in fp32 when the parameters are gathered in a lower precision (FSDP2
    would reduce in ``param_dtype``: torchtitan's ``mixed_precision_reduce="float32"``). Forward inputs are cast to
    ``param_dtype`` (FSDP2's default): a unit's floating inputs arrive in bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if reduce_dtype is None and param_dtype is not None:
        reduce_dtype = torch.float32
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def shard_dim_of(param: nn.Parameter) -> Shard | None:
    """Where ZeRO-3 shards ``param``: dim 1 for a matrix tensor parallelism splits part by part on dim 0 (a
    ``_StridedShard``: LoRA's B of GPT-2's fused q/k/v projection), else torch's default (None: dim 0). FSDP2
    stacks a strided shard of its own on that dim, which gathers such a tensor wrong (seen: B 1.4e-2 off after 10
    steps at dp=2 x tp=2)."""
    strided = isinstance(param, DTensor) and any(isinstance(p, StridedShard) and p.dim == 0 for p in param.placements)
    return Shard(1) if strided and param.dim() > 1 else None


def set_prefetch(root: nn.Module, units: list[str]) -> list[tuple[str, str]]:
    """Explicit prefetch between consecutive sibling units (the repeated blocks, in forward order): each block's
    forward starts the all-gather of the next one's parameters, each block's backward that of the previous one
    (torchtitan's setting; FSDP2 alone prefetches only in backward). Returns the (unit, prefetched) pairs."""
    siblings: dict[str, list[str]] = {}
    for unit in units:
        if unit:
            siblings.setdefault(unit.rpartition(".")[0], []).append(unit)
    order = {name: i for i, (name, _) in enumerate(root.named_modules())}
    blocks = sorted(max(siblings.values(), key=len, default=[]), key=order.__getitem__)
    pairs = []
    for first, second in zip(blocks, blocks[1:]):
        a, b = root.get_submodule(first), root.get_submodule(second)
        a.set_modules_to_forward_prefetch([b])  # type: ignore[operator]
        b.set_modules_to_backward_prefetch([a])  # type: ignore[operator]
        pairs.append((first, second))
    return pairs


@register_sharding("zero3")
class ShardParameters(DataParallelSharding):
    """Stage 3: parameters too, with torch's FSDP2; gradients arrive reduce-scattered as DTensors.

    Units whose gradients are divided by something other than their group's size (expert units: every data-parallel
    rank; HSDP: both steps) reduce with a plain sum and one division after it, on every device
    (``set_force_sum_reduction_for_comms``). Without it FSDP2 (torch 2.13, ``_get_gradient_divide_factors``) takes
    another path on CUDA than on the CPU: a ``PREMUL_SUM(1/f)`` reduce-scatter (gloo has none) for expert units and
    NCCL's ``AVG`` at each HSDP step. Both are the same mean, sum(g_i / f) against sum(g_i) / f, equal bitwise
    when f is a power of two and within float rounding otherwise; forcing the sum makes CUDA run exactly the
    arithmetic the CPU parity tests check, for one division of the reduced shard (1/dp of the gradients; fp16 takes
    this path anyway). Not on a group of one: torch's copy for a single rank divides, and the forced post-divide
    would divide again; unforced, it divides once on every device (pre- and post-factors stay None for fp32/bf16).
    Plain units keep FSDP2's default ``AVG``, which gloo 2.13 has too.

    Mixed precision (``param_dtype``: bf16 under ``bf16-mixed``): every unit, expert units included, gathers its
    parameters in bf16 and reduces gradients in fp32 (or grad_compression's dtype), FSDP2's ``MixedPrecisionPolicy``
    as torchtitan sets it; the sharded parameters, gradients and optimizer states stay fp32. MoE routers
    (:func:`router_units`) are units of their own gathered in fp32. So ZeRO-3 computes from bf16-rounded parameters
    where ZeRO 0-2 autocast from fp32 ones (docs/precision.md states the difference).

    HSDP: FSDP2 on the 2-D (replicate, shard) mesh is HSDP (``fully_shard`` reduce-scatters over the shard dimension,
    then all-reduces over the replicate one: ``foreach_reduce`` in torch's ``_fully_shard``).
    """

    stage = 3
    sharded = frozenset({"optimizer", "grads", "params"})
    comm_factor = 1.5  # parameters gathered for forward and again for backward, gradients reduce-scattered
    supports_offload = True
    summary = "optimizer states, gradients and parameters sharded (FSDP2)"

    @classmethod
    def comm_bytes(cls, grad_bytes: float, dp: int, gather_ratio: float = 1.0) -> float:
        """Two all-gathers of the parameters (forward and backward), each ``gather_ratio`` times the gradients'
        bytes (0.5: bf16 gathers under ``bf16-mixed``), and one reduce-scatter of the gradients: (2 r + 1) g (w-1)/w
        (``comm_factor`` 1.5 all-reduces at r = 1)."""
        return (2 * gather_ratio + 1) * grad_bytes * (dp - 1) / dp if dp > 1 else 0.0

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh the non-expert units shard over (HSDP: the 2-D replicate x shard mesh)."""
        return self.hsdp_mesh if self.hsdp_mesh is not None else self.mesh

    def shard_module(self, root: nn.Module, units: list[str] | None = None) -> list[str]:
        # experts split over ep first, as units of their own over the ranks holding the same experts (torchtitan's
        # dp_mod_ep); the enclosing units then leave their parameters alone
        experts = expert_units(root)
        alone = self.expert_mesh.size() == 1
        for path in experts:
            settings = {
                "reshard_after_forward": self.reshard_after_forward,
                "offload": self.offload,
                # nothing travels on a group of one, and an fp16 reduce dtype there would divide by f^2, not f (torch
                # 2.13 pre- and post-divides fp16 by factors of f, and its copy for a single rank divides by f too)
                "reduce_dtype": None if alone else self.wire_dtype,
                "param_dtype": self.param_dtype,
            }
            apply_fsdp(root, self.expert_mesh, units=[path], **settings)
            unit = root.get_submodule(path)
            unit.set_gradient_divide_factor(float(self.data_parallel_size))  # type: ignore[operator]
            if not alone:
                force_sum_reduction(unit)
        units = fsdp_units(root) if units is None else units
        # MoE routers stay fp32 when the rest is gathered in bf16: units of their own, innermost, so the enclosing
        # block's unit leaves them alone
        routers = tuple(router_units(root)) if self.param_dtype is not None else ()
        made = apply_fsdp(
            root,
            self.fsdp_mesh,
            reshard_after_forward=self.reshard_after_forward,
            offload=self.offload,
            units=[*routers, *units],
            reduce_dtype=self.wire_dtype,
            param_dtype=self.param_dtype,
            full_precision=routers,
        )
        for path in made if self.hsdp_mesh is not None else []:
            # HSDP: sum both steps and divide once after, on every device (see above)
            force_sum_reduction(root.get_submodule(path))
        return experts + made


def force_sum_reduction(unit: nn.Module) -> None:
    """FSDP2's plain sum and one division after it (``set_force_sum_reduction_for_comms``: torch 2.11 and 2.13 have
    it). Without it the unit keeps FSDP2's own reduction (``PREMUL_SUM``/``AVG`` on NCCL: the same mean within float
    rounding, not bitwise the CPU tests' arithmetic), with a warning that says so; gloo then has no ``PREMUL_SUM``."""
    if hasattr(unit, "set_force_sum_reduction_for_comms"):
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        return
    warnings.warn(
        f"torch {torch.__version__}'s FSDP2 has no set_force_sum_reduction_for_comms: expert and HSDP units reduce "
        "with FSDP2's own PREMUL_SUM/AVG (the same mean within float rounding; gloo has no PREMUL_SUM). "
        "torch 2.11 and 2.13 have it.",
        stacklevel=2,
    )


def expert_units(root: nn.Module) -> list[str]:
    """Paths of the modules whose parameters are split over the expert-parallel axis."""
    return [
        name
        for name, module in root.named_modules()
        if name and any(is_expert_param(p) for p in module.parameters(recurse=False))
    ]
