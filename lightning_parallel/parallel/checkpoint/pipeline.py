"""Optimizer states of a pipelined model in the single-process format, and back. Pure torch.

Each pp rank's optimizer holds only its stages' parameters, numbered from 0. A single-process optimizer
numbers all of them, group by group, in the order ``configure_optimizers`` listed them, which for a
module whose groups are built from ``self.parameters()`` is the unsplit model's parameter order. So the
stages' states are merged by parameter name, ordered by that order, and renumbered; tied copies (one per
stage) become the one parameter the single-process model has.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.parallel.pipeline.split import PipelineSplit


def _all_gather(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def _merged_group_names(
    local_names: list[list[str]], split: PipelineSplit, group: dist.ProcessGroup
) -> list[list[str]]:
    """Every group's canonical parameter names over all stages, in single-process order (collective)."""
    mine = [[split.canonical[n] for n in names] for names in local_names]
    position = {name: i for i, name in enumerate(split.order)}
    merged = []
    for parts in zip(*_all_gather(mine, group)):
        names = {n for part in parts for n in part}
        merged.append(sorted(names, key=position.__getitem__))
    return merged


def gather_pipeline_optimizer_state(
    local: dict[str, Any], local_names: list[list[str]], split: PipelineSplit, group: dist.ProcessGroup
) -> dict[str, Any]:
    """Merge the stages' index-keyed optimizer states into one single-process state (collective over pp).

    Args:
        local: this rank's optimizer state, keyed by its local indices.
        local_names: the parameter names of this rank's optimizer groups, in group order.
    """
    index_to_name = [split.canonical[n] for names in local_names for n in names]
    by_name = {index_to_name[i]: s for i, s in local.get("state", {}).items()}
    groups = local.get("param_groups", [])
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    everyone = _all_gather((by_name, hyper), group)
    merged_names = _merged_group_names(local_names, split, group)
    state: dict[int, Any] = {}
    param_groups = []
    index = 0
    for g, names in enumerate(merged_names):
        ids = list(range(index, index + len(names)))
        index += len(names)
        settings = next((h[g] for _, h in everyone if g < len(h)), {})
        param_groups.append({**settings, "params": ids})
        for i, name in zip(ids, names):
            found = next((s[name] for s, _ in everyone if name in s), None)
            if found is not None:
                state[i] = found
    return {"state": state, "param_groups": param_groups}


def pipeline_local_optimizer_state(
    full: dict[str, Any], local_names: list[list[str]], split: PipelineSplit, group: dist.ProcessGroup
) -> dict[str, Any]:
    """This rank's part of a single-process optimizer state, keyed by its local indices (collective)."""
    merged_names = _merged_group_names(local_names, split, group)
    saved_groups = full["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(n) for n in merged_names]:
        raise ValueError(
            "The checkpoint's optimizer groups hold "
            f"{[len(g['params']) for g in saved_groups]} parameters, this model's {[len(n) for n in merged_names]}: "
            "the checkpoint is from a different model or optimizer setup."
        )
    full_index = {name: i for names, g in zip(merged_names, saved_groups) for name, i in zip(names, g["params"])}
    state: dict[int, Any] = {}
    param_groups = []
    index = 0
    for names, saved in zip(local_names, saved_groups):
        ids = list(range(index, index + len(names)))
        index += len(names)
        param_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        for i, name in zip(ids, names):
            entry = full["state"].get(full_index[split.canonical[name]])
            if entry is not None:  # copied: tied copies on one rank must not share their moments
                state[i] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
    return {"state": state, "param_groups": param_groups}
