"""Splitting a model into pipeline stages, in place. Pure torch.

This rank keeps its stages' layers under their original names (so checkpoints do not depend on the layout) and
every other layer is swapped for a parameter-free placeholder. Weights tied across stages (GPT's embedding and
head) become one parameter per kept site; :class:`~lightning_parallel.parallel.pipeline.tied.TiedGradients`
keeps the copies equal. Layers built on the meta device are materialized here, this rank's only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.parallel.tensor.plan import tied_parameters


def layer_paths(root: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """The module path of every layer inside ``root``."""
    names = {id(m): name for name, m in root.named_modules()}
    paths = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module) or id(layer) not in names:
            raise TypeError(
                f"pipeline_layers()[{i}] ({type(layer).__name__}) is not a submodule of {type(root).__name__}: "
                "return the module's own layers, in the order its forward runs them."
            )
        paths.append(names[id(layer)])
    if len(set(paths)) != len(paths):
        raise TypeError("pipeline_layers() lists a layer twice: list each layer once, in forward order.")
    return paths


class ElsewhereLayer(nn.Module):
    """Stands in for a layer that another pipeline stage holds; it has no parameters and cannot run.
    ``embedding_sizes``: the rows of the embeddings in the layer it stands for (MuonAdamW's split rule tells the
    vocabulary head on a stage without the embedding by them)."""

    def __init__(self, path: str, stage: int, embedding_sizes: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.path, self.stage, self.embedding_sizes = path, stage, embedding_sizes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.path} lives on pipeline stage {self.stage}, not on this rank: under pp > 1 run the model "
            "through the strategy (self(x) then self.loss(output, target) in a step), not layer by layer."
        )

    def extra_repr(self) -> str:
        return f"{self.path} on stage {self.stage}"


class StageModule(nn.Module):
    """A contiguous run of layers, called in order: what one pipeline stage computes.

    With ``output_asks_grad`` (set under schedules that split the backward, zero bubble), a floating-point output
    that no gradient would flow into (every weight before it frozen: a LoRA base's first stages) leaves as a leaf
    that asks for one. torch's input-gradient pass finds a stage's weights through the graph from its inputs, so
    the next stages' adapters would otherwise get no gradient (torch special-cases stage 0 alone).
    """

    output_asks_grad = False

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = self.layers[0](*args, **kwargs)
        for layer in self.layers[1:]:
            x = layer(x)
        if not isinstance(x, Tensor):
            return x
        if self.output_asks_grad and torch.is_grad_enabled() and x.is_floating_point() and not x.requires_grad:
            return x.detach().requires_grad_()
        return x.clone() if x._is_view() else x  # stages detach their outputs in place, which views do not allow


@dataclass
class PipelineSplit:
    """This rank's part of a model split into pipeline stages."""

    stages: dict[int, StageModule]  # stage index -> its layers, for the stages this rank runs
    num_stages: int
    stage_ranks: list[int]  # pp rank of every stage
    tie_groups: list[list[str]]  # parameter names that were one tied weight before the split
    canonical: dict[str, str] = field(default_factory=dict)  # every parameter name -> its first name
    order: list[str] = field(default_factory=list)  # canonical parameter names in the unsplit model's order

    def layers(self) -> list[nn.Module]:
        """This rank's layers, stage by stage."""
        return [layer for _, stage in sorted(self.stages.items()) for layer in stage.layers]

    def parameters(self) -> list[nn.Parameter]:
        """This rank's stage parameters, each once."""
        return list(dict.fromkeys(p for stage in self.stages.values() for p in stage.parameters()))


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def split_model(
    root: nn.Module, paths: Sequence[str], partition: Sequence[range], stage_ranks: Sequence[int], pp_rank: int
) -> PipelineSplit:
    """Keep only this rank's stages in ``root`` (in place) and return them as stage modules.

    Tied weights are untied into one parameter per kept site; ``tie_groups`` names them for
    :class:`TiedGradients`.
    """
    canonical: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        canonical[name] = first_name.setdefault(id(p), name)
    order = list(dict.fromkeys(canonical.values()))
    ties = [[f"{path}.{name}" if path else name for path, name in sites] for sites in tied_parameters(root)]

    stages: dict[int, StageModule] = {}
    for stage, layer_range in enumerate(partition):
        if stage_ranks[stage] == pp_rank:
            stages[stage] = StageModule([root.get_submodule(paths[i]) for i in layer_range])
        else:
            for i in layer_range:
                layer = root.get_submodule(paths[i])
                sizes = tuple(m.num_embeddings for m in layer.modules() if isinstance(m, nn.Embedding))
                _set_module(root, paths[i], ElsewhereLayer(paths[i], stage, sizes))

    kept = dict(root.named_parameters(remove_duplicate=False))
    for names in ties:
        here = [n for n in names if n in kept]
        for name in here[1:]:  # each site its own parameter; TiedGradients keeps them equal
            module_path, _, attr = name.rpartition(".")
            module = root.get_submodule(module_path) if module_path else root
            original = getattr(module, attr)
            setattr(module, attr, nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad))
    return PipelineSplit(stages, len(partition), list(stage_ranks), ties, canonical, order)


def materialize_stages(split: PipelineSplit, device: torch.device) -> None:
    """Give this rank's stages real storage and initial values when they were built on the meta device
    (each layer's own ``reset_parameters()`` initializes it)."""
    for stage in split.stages.values():
        if not any(t.is_meta for t in (*stage.parameters(), *stage.buffers())):
            continue
        stage.to_empty(device=device)
        for layer in stage.layers:
            check_resettable(layer)
            layer.reset_parameters()


def check_resettable(layer: nn.Module) -> None:
    """A pipeline layer built on meta is initialized by its own ``reset_parameters()``."""
    if not callable(getattr(layer, "reset_parameters", None)):
        raise TypeError(
            f"{type(layer).__name__} is built on the meta device under pp (in configure_model) but has no "
            "reset_parameters(): give each pipeline layer a reset_parameters() that initializes all its weights, "
            "or build the model in __init__ instead of configure_model."
        )
