"""A Fabric user's optimizer, built over the unsplit model, re-pointed at what the split left on this rank."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from lightning_parallel.parallel.pipeline.split import PipelineSplit


def repoint(
    optimizer: Optimizer, module: nn.Module, split: PipelineSplit | None, names: dict[int, str], owner: str
) -> None:
    """Each parameter of ``optimizer`` becomes what this rank holds under its name: its split (tp, ZeRO-3), nothing
    (pp: another stage's), or one parameter per site of a weight tied across stages (pp: each kept copy).

    Args:
        optimizer: built over the unsplit model's parameters.
        module: the split model.
        split: under pp, this rank's stages (their canonical names of tied copies); else None.
        names: the unsplit model's parameters by id (noted before the split).
        owner: the strategy's name, for the error.
    """
    now = dict(module.named_parameters(remove_duplicate=False))
    current = {id(p) for p in now.values()}
    held: dict[str, list[nn.Parameter]] = {}  # the unsplit model's name -> this rank's parameters under it
    named: dict[int, str] = {}  # this rank's parameters -> that name
    for name, p in now.items():
        key = split.canonical.get(name, name) if split is not None else name
        copies = held.setdefault(key, [])
        named.setdefault(id(p), key)
        if all(p is not q for q in copies):
            copies.append(p)
    for group in optimizer.param_groups:
        params: list[nn.Parameter] = []
        for p in group["params"]:
            # a parameter of the split model by its own name: the id of one the split replaced may be reused
            name = named[id(p)] if id(p) in current else names.get(id(p))
            if name is None and id(p) not in current:
                raise ValueError(
                    f"{owner}: the optimizer holds a parameter of shape {tuple(p.shape)} that is not "
                    "the model's: build the optimizer over model.parameters() of the model you set up."
                )
            found = [p] if name is None else held.get(name, [])
            params.extend(q for q in found if all(q is not r for r in params))
        group["params"] = params
