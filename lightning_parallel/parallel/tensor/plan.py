"""Megatron-style tensor parallelism with DTensor plans on the ``tp`` axis. Pure torch.

A plan is a plain dict of module path (``*`` matches one name) to a torch ``ParallelStyle``; models keep
their own plan beside their code. What torch leaves to us: weights tied across two modules (GPT's
embedding and head) come out of ``parallelize_module`` as two separate parameters, so they are tied
again here, and a tie whose two sides were given different placements is refused.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_parallel.parallel.float8 import float8_tp_plan


def sp_with_pp(family: str) -> str:
    """The one refusal of sequence parallelism beside pp, for a ``family`` whose pipeline stages rebuild positions
    from the hidden state they receive, which sequence parallelism splits (Hugging Face's and LitGPT's models)."""
    return (
        f"sequence_parallel=True with pp > 1 is not supported for {family} models yet: set one of them off (set "
        "sequence_parallel=False or pp=1)."
    )


def tied_parameters(root: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module path, parameter name) that share one Parameter object."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), [])
            if (path, name) not in owners[id(p)]:
                owners[id(p)].append((path, name))
    return [sites for sites in owners.values() if len(sites) > 1]


def _sharded_dim(style: ParallelStyle, module: nn.Module) -> tuple[str, int] | None:
    """The size a style splits across tp ranks, named for the error message."""
    if isinstance(module, nn.Linear):
        if isinstance(style, ColwiseParallel):
            return "out_features", module.out_features
        if isinstance(style, RowwiseParallel):
            return "in_features", module.in_features
    if isinstance(module, nn.Embedding):
        if isinstance(style, ColwiseParallel):
            return "embedding_dim", module.embedding_dim
        if isinstance(style, RowwiseParallel):
            return "num_embeddings (the vocabulary)", module.num_embeddings
    return None


def check_tp_plan(root: nn.Module, plan: Mapping[str, ParallelStyle], tp: int, require_match: bool = True) -> None:
    """Every dimension the plan splits must divide by ``tp``; no process group needed. With
    ``require_match`` (the model is built), every entry must name a module: a misspelled path would
    leave that module unsplit."""
    unmatched = dict.fromkeys(plan)
    for path, module in root.named_modules():
        for pattern, style in plan.items():
            if not path_matches(path, pattern):
                continue
            unmatched.pop(pattern, None)
            split = _sharded_dim(style, module)
            if split and split[1] % tp:
                raise ValueError(
                    f"tp={tp} does not divide {path}.{split[0]}={split[1]}: choose tp among the divisors of "
                    f"{split[1]}, or change the model's size."
                )
    if require_match and unmatched:
        raise ValueError(
            f"tensor_parallel_plan entry {next(iter(unmatched))!r} names no module of {type(root).__name__}: fix "
            "the path (module names as named_modules() lists them, '*' for one name) or drop the entry."
        )


def apply_tp(root: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> None:
    """Shard ``root`` in place over ``tp_mesh`` following ``plan``, keeping tied weights tied and frozen weights
    frozen."""
    ties = tied_parameters(root)
    # a style may make each weight a new nn.Parameter(...), which requires a gradient (torch 2.13's SequenceParallel,
    # the Conv1D styles): a frozen weight (a LoRA base's norm) would start training
    frozen = {name for name, p in root.named_parameters(remove_duplicate=False) if not p.requires_grad}
    # layers converted to float8 (precision=fp8) take torchao's float8 tp styles, the same layouts
    parallelize_module(root, tp_mesh, float8_tp_plan(root, plan, path_matches))
    for name, p in root.named_parameters(remove_duplicate=False):
        if name in frozen:
            p.requires_grad_(False)
    for sites in ties:
        (first_path, first_name), *others = sites
        shared = getattr(root.get_submodule(first_path), first_name)
        for path, name in others:
            module = root.get_submodule(path)
            mine = getattr(module, name)
            placements = [getattr(t, "placements", None) for t in (shared, mine)]
            if isinstance(shared, DTensor) != isinstance(mine, DTensor) or placements[0] != placements[1]:
                raise ValueError(
                    f"{first_path}.{first_name} and {path}.{name} are one tied weight but the tensor-parallel "
                    f"plan places them as {placements[0]} and {placements[1]}: give both the same placement "
                    "(e.g. RowwiseParallel for the embedding and ColwiseParallel for the head shard the "
                    "vocabulary dimension of both)."
                )
            setattr(module, name, shared)


def path_matches(path: str, pattern: str) -> bool:
    """Whether a module path matches a plan pattern (``*`` stands for exactly one name)."""
    return fnmatch.fnmatchcase(path, pattern) and path.count(".") == pattern.count(".")


def resolvable_plan(
    root: nn.Module, plan: Mapping[str, ParallelStyle], placeholders: tuple[type, ...] = ()
) -> dict[str, ParallelStyle]:
    """The entries of ``plan`` that name a module ``root`` still holds (a pipeline stage holds a part); modules of
    the ``placeholders`` types stand in for layers held elsewhere (a plan may name a pipeline layer itself)."""
    paths = [path for path, m in root.named_modules() if not isinstance(m, placeholders)]
    return {pattern: style for pattern, style in plan.items() if any(path_matches(p, pattern) for p in paths)}
