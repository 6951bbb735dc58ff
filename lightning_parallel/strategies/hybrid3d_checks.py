"""Argument and model checks of hybrid3d that run before any process group exists: each names the setting
and the fix."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_parallel.mesh import check_degree


def check_degree_arg(name: str, value: object, allow_auto: bool = False) -> None:
    if allow_auto and value == "auto":
        return
    try:
        check_degree(name, value)
    except ValueError:
        if not allow_auto:
            raise
        raise ValueError(
            f"{name}={value!r} is not a parallel degree: set {name} to a positive integer or 'auto'."
        ) from None


def as_built(model: pl.LightningModule) -> pl.LightningModule | None:
    """``model`` with the layers its ``configure_model`` builds (a copy, built on the meta device: no memory),
    so layer counts, plan paths and initializers are checked before any process starts. None when that
    cannot be known: part of the model exists already, or configure_model needs the Trainer."""
    if not is_overridden("configure_model", model):
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


def check_resettable(layer: torch.nn.Module) -> None:
    """A pipeline layer built on meta is initialized by its own ``reset_parameters()``."""
    if not callable(getattr(layer, "reset_parameters", None)):
        raise TypeError(
            f"{type(layer).__name__} is built on the meta device under pp (in configure_model) but has no "
            "reset_parameters(): give each pipeline layer a reset_parameters() that initializes all its weights, "
            "or build the model in __init__ instead of configure_model."
        )


def check_virtual_stages(schedule: str, virtual: int | None) -> None:
    if virtual is None:
        return
    check_degree_arg("pp_virtual_stages", virtual)
    fixed = {"gpipe": 1, "1f1b": 1, "zero_bubble": 2}.get(schedule)
    if fixed is not None and virtual != fixed:
        raise ValueError(
            f"pp_virtual_stages={virtual} does not fit pp_schedule={schedule!r}, which runs {fixed} stage(s) per rank: "
            "leave pp_virtual_stages unset, or use pp_schedule='interleaved_1f1b' for more stages per rank."
        )
    if schedule == "interleaved_1f1b" and virtual < 2:
        raise ValueError(
            "pp_virtual_stages=1 makes interleaved_1f1b plain 1F1B: set it to 2 or more, or use pp_schedule='1f1b'."
        )


def check_memory_budget(balance: str, budget: int | None) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ValueError(f"pp_memory_budget={budget!r} is not a byte count: set it to a positive number or None.")
    if balance != "profile":
        rank_zero_warn(f"pp_memory_budget only applies with pp_balance='profile': ignored with {balance!r}.")
