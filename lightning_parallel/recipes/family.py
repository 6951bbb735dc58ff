"""What a model family refuses, for the analytic planner: the checks the recipe runs before launch
(:func:`~lightning_parallel.recipes.hf.check_hf_layout`, :func:`~lightning_parallel.recipes.litgpt.check_litgpt_layout`)
and the experts' checks its workers run, called on the model built on the meta device from the planner's config, so
the planner never proposes a layout the recipe would refuse (sequence parallelism with pp, ep on a dense model, tp
not dividing the vocabulary, cp on attention it cannot split). ``strategy=auto`` in the recipes plans ``model=hf*`` and
``model=litgpt`` with :func:`recipe_model_plan` (the same checks, and LoRA's under ``peft=lora``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from lightning_parallel.parallel.context import check_sequence
from lightning_parallel.parallel.expert.apply import check_expert_layout
from lightning_parallel.planning.layout import Layout

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from lightning_parallel.planning.hf_config import ModelShape

Refusal = Callable[[Layout], str]


def family_refusal(model: str, lora: bool = False) -> Refusal | None:
    """Why the family of ``model`` (a Hugging Face config.json or folder, or a LitGPT name) refuses a layout, ""
    if it takes it; None for a model of neither family (a recipe GPT: the planner's own checks). ``lora``: LoRA
    adapters with their default settings train too (``plan --lora-rank``): LitGPT's refuse cp and ep; peft's take
    every layout without dropout."""
    if Path(model).is_dir() or model.endswith(".json"):
        return _cached(_hf_checks(_hf_meta(model)))
    try:
        return _cached(_litgpt_checks(model, lora))
    except (ImportError, ValueError):  # no litgpt, or no LitGPT name
        return None


def recipe_model_plan(cfg: DictConfig) -> tuple[ModelShape, Refusal]:
    """``strategy=auto`` with ``model=hf*`` or ``model=litgpt``: the model's shape for the analytic planner, and why
    its family refuses a layout, from the recipe's own pre-launch checks of the model and, with ``peft=lora``, of
    the adapters (a LoRA variant tp does not split: ``peft.dropout`` > 0 refuses tp > 1).

    Raises:
        ValueError, FileNotFoundError: the model settings the recipe refuses, before any layout is planned.
    """
    from lightning_parallel.planning.hf_config import from_hf_config, litgpt_shape
    from lightning_parallel.recipes.hf import check_hf_model, hf_config, is_hf_model
    from lightning_parallel.recipes.litgpt import check_litgpt_model, litgpt_config
    from lightning_parallel.recipes.lora import check_hf_lora, check_litgpt_lora, wants_lora

    lora = wants_lora(cfg)
    if is_hf_model(cfg.model):
        meta, config = check_hf_model(cfg), hf_config(cfg.model)
        shape = from_hf_config(config.to_dict(), name=Path(cfg.model.path or config.model_type).name)
        family = _hf_checks(meta)

        refused: dict[bool, str] = {}  # by sequence parallelism: the adapters' checks read tp > 1 and SP only

        def adapters(pp: int, tp: int, cp: int, ep: int, sequence_parallel: bool) -> None:
            if tp > 1 and sequence_parallel not in refused:
                try:  # the adapters go into a fresh meta model
                    check_hf_lora(cfg, check_hf_model(cfg), {"tp": tp}, sequence_parallel)
                    refused[sequence_parallel] = ""
                except ValueError as err:
                    refused[sequence_parallel] = str(err)
            if tp > 1 and refused[sequence_parallel]:
                raise ValueError(refused[sequence_parallel])
    else:
        meta, config = check_litgpt_model(cfg), litgpt_config(cfg.model)
        shape, family = litgpt_shape(config), _litgpt_meta_checks(meta)

        def adapters(pp: int, tp: int, cp: int, ep: int, sequence_parallel: bool) -> None:
            check_litgpt_lora(cfg, config, {"pp": pp, "tp": tp, "cp": cp, "ep": ep})

    def check(*degrees: Any) -> None:
        check_sequence(cfg.model.seq_len, degrees[2], setting="strategy.cp")  # pp, tp, cp, ep, SP
        family(*degrees)
        if lora:
            adapters(*degrees)

    return shape, _cached(check)


def _hf_meta(model: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    file = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
    fields = json.loads(file.read_text())
    config = AutoConfig.for_model(**fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _hf_checks(meta: Any) -> Callable[..., None]:
    from lightning_parallel.hf.experts import check_hf_expert_degrees, hf_expert_parallel_plan
    from lightning_parallel.recipes.hf import check_hf_layout

    def check(pp: int, tp: int, cp: int, ep: int, sequence_parallel: bool) -> None:
        check_hf_layout(meta, pp=pp, tp=tp, sequence_parallel=sequence_parallel, cp=cp)
        check_hf_expert_degrees(meta, ep=ep)  # HFCausalLM.check_parallel_degrees, in the workers
        if ep > 1:  # strategies.checks.check_model, in the workers
            check_expert_layout(meta, ep, hf_expert_parallel_plan(meta))

    return check


def _litgpt_checks(name: str, lora: bool = False) -> Callable[..., None]:
    from litgpt import Config
    from litgpt.model import GPT

    with torch.device("meta"):
        return _litgpt_meta_checks(GPT(Config.from_name(name)), lora)


def _litgpt_meta_checks(meta: Any, lora: bool = False) -> Callable[..., None]:
    from lightning_parallel.litgpt.lora import check_lora_degrees
    from lightning_parallel.recipes.litgpt import check_litgpt_layout

    def check(pp: int, tp: int, cp: int, ep: int, sequence_parallel: bool) -> None:
        check_litgpt_layout(meta, pp=pp, tp=tp, sequence_parallel=sequence_parallel, cp=cp)
        if ep > 1:  # LitGPTCausalLM has no expert plan: check_model looks for the package's MoE layers
            check_expert_layout(meta, ep, {})
        if lora:  # LitGPTCausalLM(lora=...)'s own layout checks, without dropout
            check_lora_degrees(SimpleNamespace(lora_dropout=0.0), pp=pp, tp=tp, cp=cp, ep=ep)

    return check


def _cached(check: Callable[..., None]) -> Refusal:
    """The refusal of a layout by its degrees and sequence parallelism (all the checks read), each asked once."""
    seen: dict[tuple, str] = {}

    def refuses(layout: Layout) -> str:
        key = (layout.pp, layout.tp, layout.cp, layout.ep, layout.sequence_parallel)
        if key not in seen:
            try:
                check(*key)
                seen[key] = ""
            except ValueError as err:
                seen[key] = str(err)
        return seen[key]

    return refuses
