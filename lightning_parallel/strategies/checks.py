"""Checks of a model against a layout that run before any process group exists, in the process that launches
the others: each names the setting and the fix."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.context.apply import check_context_layout
from lightning_parallel.parallel.expert.apply import check_expert_layout
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.parallel.parallelize import stage_partition
from lightning_parallel.parallel.pipeline.profile import example_microbatch
from lightning_parallel.parallel.pipeline.split import check_resettable
from lightning_parallel.parallel.spatial.layout import check_spatial_layout
from lightning_parallel.parallel.tensor.plan import check_tp_plan
from lightning_parallel.protocol import (
    check_parallel_degrees,
    expert_parallel_plan,
    pipeline_layers,
    require_pipelined,
    spatial_gather_modules,
    tensor_parallel_plan,
)

# the layout a module was checked against before launch (checked_before_launch): the workers do not repeat it
CHECKED_LAYOUT = "_checked_before_launch"


def checked_before_launch(model: Any, config: ParallelConfig) -> None:
    """Say that ``model``'s layout ``config`` was checked before launch, by the process that started this one
    (a recipe's ``check_config`` on the same module built on meta): :func:`check_model` does not repeat it."""
    object.__setattr__(model, CHECKED_LAYOUT, config)


def check_model(model: Any, config: ParallelConfig, dims: ParallelDims) -> None:
    """Refuse a model ``dims`` cannot split: no protocol method where an axis needs one, a plan that names no
    module or splits a size tp does not divide, more stages than layers, meta layers that cannot initialize
    themselves, degrees the model itself refuses. The one check of a model against a layout: the recipes call it
    before launch on the module built on meta; nothing for a model marked :func:`checked_before_launch`."""
    if getattr(model, CHECKED_LAYOUT, None) == config:
        return
    # what configure_model makes, on meta; None when that cannot be known here
    built = as_built(model) if dims.pp > 1 or dims.tp > 1 or dims.ep > 1 or dims.cp > 1 else model
    plan = tensor_parallel_plan(model, dims.tp, config.sequence_parallel) if dims.tp > 1 else None
    # the model's own refusals (after its plan, which notes sequence_parallel) before the generic checks ask it for
    # what it lacks: it names what it cannot take (heads tp does not divide, LoRA adapters under pp, cp or ep)
    check_parallel_degrees(model, dims)
    if plan is not None:
        check_tp_plan(model if built is None else built, plan, dims.tp, require_match=built is not None)
    if dims.ep > 1 and built is not None:
        check_expert_layout(built, dims.ep, expert_parallel_plan(model))
    if dims.pp > 1:
        require_pipelined(model, dims.pp)
        if config.pp_balance == "profile":
            example_microbatch(model)  # a missing example fails before launch; it is timed after
        try:
            layers = pipeline_layers(model if built is None else built, dims.pp)
            stage_partition(layers, model, config, dims.pp, measure=False)  # more stages than layers fails here
        except AttributeError:
            if not isinstance(model, pl.LightningModule) or not is_overridden("configure_model", model):
                raise
            # layers built in configure_model do not exist yet: checked when the model is split
        if built is not None and built is not model:  # built on meta: each layer must initialize itself
            for layer in built.pipeline_layers():
                check_resettable(layer)
    # the model as built (as_built gives None for one built already: it is itself)
    target = built if built is not None else model if next(model.parameters(), None) is not None else None
    example = getattr(model, "example_input_array", None)
    if dims.context > 1 and target is not None:
        check_context_layout(target, dims.cp, config.cp_mode, dims.tp, example)
    if dims.spatial > 1:  # convolutions to split, gather modules that exist, heights that divide
        gather = spatial_gather_modules(model, dims.spatial)
        if target is not None:
            check_spatial_layout(target, dims.spatial, gather, example)


def as_built(model: pl.LightningModule) -> pl.LightningModule | None:
    """``model`` with the layers its ``configure_model`` builds (a copy, built on the meta device: no memory),
    so layer counts, plan paths and initializers are checked before any process starts. None when that
    cannot be known: part of the model exists already, or configure_model needs the Trainer. A plain
    ``nn.Module`` (Fabric's) is built already: itself."""
    if not isinstance(model, pl.LightningModule) or not is_overridden("configure_model", model):
        return model
    if next(model.parameters(), None) is not None:
        return None  # copying built weights could cost gigabytes; what configure_model adds is checked later
    probe = copy.deepcopy(model)
    try:
        with torch.device("meta"):
            probe.configure_model()
    except Exception:  # e.g. it reads self.trainer: the real build reports it, in its own context
        return None
    return probe
