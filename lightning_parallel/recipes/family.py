"""What a model family refuses, for the analytic planner: the module the recipe trains (HFCausalLM,
LitGPTCausalLM), built on the meta device from the planner's config, asked what the strategy's check before launch
asks it (its tensor-parallel plan, its own ``check_parallel_degrees``, the experts' layout), so the planner never
proposes a layout the recipe would refuse (sequence parallelism with pp, ep on a dense model, tp not dividing the
vocabulary, cp on attention it cannot split). ``strategy=auto`` in the recipes plans ``model=hf*`` and ``model=litgpt``
with :func:`recipe_model_refusal`: the module the workers will train (with its adapters under ``peft=lora``) asked the
same, and ``model.seq_len`` against cp."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_parallel.parallel.context import check_sequence
from lightning_parallel.parallel.expert.apply import check_expert_layout
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.planning.layout import Layout
from lightning_parallel.protocol import check_parallel_degrees, expert_parallel_plan, tensor_parallel_plan

if TYPE_CHECKING:
    from omegaconf import DictConfig

Refusal = Callable[[Layout], str]


def family_refusal(model: str, lora: bool = False) -> Refusal | None:
    """Why the family of ``model`` (a Hugging Face config.json or folder, or a LitGPT name) refuses a layout, ""
    if it takes it; None for a model of neither family (a recipe GPT: the planner's own checks). ``lora``: LoRA
    adapters with their default settings train too (``plan --lora-rank``): LitGPT's refuse cp and ep; peft's take
    every layout without dropout."""
    if Path(model).is_dir() or model.endswith(".json"):
        return _cached(_module_checks(_hf_meta(model)))
    try:
        return _cached(_litgpt_checks(model, lora))
    except (ImportError, ValueError):  # no litgpt, or no LitGPT name
        return None


def _hf_meta(model: str) -> Any:
    from transformers import AutoConfig

    from lightning_parallel.hf import HFCausalLM

    file = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
    fields = json.loads(file.read_text())
    with torch.device("meta"):
        return HFCausalLM(AutoConfig.for_model(**fields))


def recipe_model_refusal(cfg: DictConfig) -> Refusal:
    """``strategy=auto`` with a library family (``model=hf*``, ``model=litgpt``): why a layout is refused, from
    what the strategy's check before launch asks the module ``kind`` builds on meta (its adapters too under
    ``peft=lora``: ``peft.dropout`` > 0 refuses tp > 1), and ``model.seq_len`` against cp. The kind is the
    config's ``model.kind`` (resolved).

    Raises:
        ValueError, FileNotFoundError: the model settings the recipe refuses, before any layout is planned.
    """
    from lightning_parallel.recipes.common import recipe_names
    from lightning_parallel.recipes.lora import wants_lora
    from lightning_parallel.recipes.model_kinds import kind_of

    kind, lora = kind_of(cfg.model), wants_lora(cfg)
    kind.check(cfg)
    family = _module_checks(kind.meta_module(cfg))

    def check(dims: ParallelDims, sequence_parallel: bool) -> None:
        check_sequence(cfg.model.seq_len, dims.cp, setting="strategy.cp")
        with recipe_names(lora):  # the module's names of the settings, and the recipe's
            family(dims, sequence_parallel)

    return _cached(check)


def _litgpt_checks(name: str, lora: bool = False) -> Callable[..., None]:
    from litgpt import Config

    from lightning_parallel.litgpt import LitGPTCausalLM

    with torch.device("meta"):
        # LoRA with its defaults (no dropout): LitGPTCausalLM(lora=...)'s own layout checks
        adapters = {"lora_r": 8, "lora_query": True, "lora_value": True} if lora else None
        return _module_checks(LitGPTCausalLM(Config.from_name(name), lora=adapters))


def _module_checks(module: Any) -> Callable[..., None]:
    """The degrees' checks of ``module`` as :func:`~lightning_parallel.strategies.checks.check_model` runs them."""

    def check(dims: ParallelDims, sequence_parallel: bool) -> None:
        if dims.tp > 1:  # the plan notes sequence_parallel, which the module's own check reads
            tensor_parallel_plan(module, dims.tp, sequence_parallel)
        check_parallel_degrees(module, dims)
        if dims.ep > 1:
            check_expert_layout(module, dims.ep, expert_parallel_plan(module))

    return check


def _cached(check: Callable[..., None]) -> Refusal:
    """The refusal of a layout by its degrees and sequence parallelism (all the checks read), each asked once."""
    seen: dict[tuple, str] = {}

    def refuses(layout: Layout) -> str:
        key = (ParallelDims.of(pp=layout.pp, tp=layout.tp, cp=layout.cp, ep=layout.ep), layout.sequence_parallel)
        if key not in seen:
            try:
                check(*key)
                seen[key] = ""
            except ValueError as err:
                seen[key] = str(err)
        return seen[key]

    return refuses
