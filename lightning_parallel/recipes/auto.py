"""``strategy=auto`` in the recipes (recipes/train_gpt.py and train_vgg.py call :func:`resolve_auto` before their
checks): before any worker starts, the planner's layout for the job
(:mod:`lightning_parallel.planning.auto`) replaces ``strategy=auto`` by ``strategy=hybrid3d`` with the chosen degrees,
logged with its predicted figures; ``cfg.strategy.planned`` carries them to the workers, and metrics.json's
``planned`` beside the measured ones. Each process that runs the checks (the parent, or every rank under torchrun)
plans from the same config and machine, without timing anything, so every rank gets the same layout. The recipe
models are profiled on the meta device; ``model=hf*`` and ``model=litgpt`` are planned by their shape over every axis
(cp, HSDP and sequence parallelism too), never with a layout their family or ``peft=lora`` refuses
(:func:`~lightning_parallel.recipes.family.recipe_model_refusal`). The GPU is read
once per planning process, for the device it runs on (:func:`planning_gpu`): the workers the parent starts receive
the plan and read nothing."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.mesh import PLAIN_AXES
from lightning_parallel.parallel.sections import recipe_key

log = logging.getLogger(__name__)

AUTO_KEYS = ("auto_device_memory", "planned", "simulate")  # AutoConf's keys beside hybrid3d's
# what strategy=auto chooses, and what the planner does not model: neither may be set beside it
CHOSEN = ("dp", "pp", "tp", "ep", "zero_stage", "sharding", "activation_checkpointing", "microbatches", "pp_schedule")
CHOSEN += ("pp_virtual_stages",)
UNMODELED = ("cp", "spatial", "dp_shard", "offload", "sequence_parallel", "pp_balance", "pp_memory_budget")
UNMODELED += tuple(axis for axis in PLAIN_AXES if axis not in CHOSEN)  # an axis added since: refused until planned


def resolve_auto(cfg: DictConfig, simulate_pick: Callable[[DictConfig, Any], dict] | None = None) -> None:
    """With ``strategy=auto``: set ``cfg.strategy`` (in place) to the planner's layout for ``trainer.devices`` x
    ``trainer.num_nodes`` processes and the machine's memory per device (the other strategies' schemas have none of
    its keys).

    Args:
        cfg: the composed recipe config (GPT or VGG recipe).
        simulate_pick: with ``strategy.simulate=true``, the check of the pick before launch
            (:func:`lightning_parallel.simulate.prelaunch.simulate_pick`, which the recipe scripts pass: the
            simulator sits above the recipes): it refuses a pick that does not fit, or returns its figures.
    """
    s = cfg.strategy
    if s.name != "auto":  # its keys are refused by the other strategies' schemas (recipes/strategy_conf.py)
        return
    set_ = list(ParallelConfig.from_mapping(s).non_defaults([*CHOSEN, *UNMODELED]))
    if set_:
        key = recipe_key(set_[0])
        raise ValueError(
            f"strategy.{key}={OmegaConf.select(s, key)} cannot be set with strategy=auto: it chooses "
            f"{', '.join(CHOSEN)} itself and plans without {', '.join(UNMODELED)}. Drop the override, or use "
            "strategy=hybrid3d with the layout you want (python -m lightning_parallel.plan lists them)."
        )
    choice = plan_for(cfg)
    log.info(choice.describe())
    if s.simulate and simulate_pick is None:
        raise ValueError(
            "strategy.simulate=true: this caller gave resolve_auto no simulate_pick; launch with recipes/train_gpt.py "
            "(it passes lightning_parallel.simulate.prelaunch.simulate_pick), or pass it yourself."
        )
    simulated = simulate_pick(cfg, choice) if s.simulate and simulate_pick is not None else None
    c, default = choice.config, ParallelConfig()
    s.name = "hybrid3d"
    for key in ParallelConfig.names():  # what it chooses, and what the analytic planner adds (cp, HSDP, SP, ...)
        if key in CHOSEN or getattr(c, key) != getattr(default, key):
            OmegaConf.update(s, recipe_key(key), getattr(c, key), merge=False)
    s.planned = {**choice.planned(), **({"simulated": simulated} if simulated is not None else {})}


def plan_for(cfg: DictConfig) -> Any:
    """The :class:`~lightning_parallel.planning.auto.AutoChoice` for the recipe's model, batch, precision and job."""
    from lightning_parallel.planning.auto import choose_layout, detect_machine
    from lightning_parallel.recipes.model_kinds import kind_of
    from lightning_parallel.recipes.specs import parse_bytes

    kind, refuses, seq_len = kind_of(cfg.model), None, None
    if kind.plan is None:  # the families whose entry gives the planner's view (ModelKind.plan)
        raise ValueError(
            f"strategy=auto plans the recipe models and the library families (model=gpt_*, vgg*, hf*, litgpt), not "
            f"model.kind={kind.name}: pick a layout with strategy=hybrid3d and its strategy.dp|pp|tp|zero_stage."
        )
    spec = kind.plan(cfg.model)
    if kind.tokenized:  # a library family, by its shape, within what its module (and LoRA) takes
        from lightning_parallel.recipes.family import recipe_model_refusal

        refuses, seq_len = recipe_model_refusal(cfg), cfg.model.seq_len
    t = cfg.trainer
    memory = cfg.strategy.auto_device_memory
    try:
        memory = parse_bytes(memory) if memory is not None else None
    except ValueError:
        raise ValueError(
            f"strategy.auto_device_memory={memory!r} is not a size: write it like 80GB, 24GiB or 512MB."
        ) from None
    machine = detect_machine(t.devices * t.num_nodes, t.devices, t.accelerator, memory, planning_gpu(t.accelerator))
    batch = max(1, cfg.data.global_batch_size // max(1, t.accumulate_grad_batches))  # samples per forward
    group = cfg.get("optimizer")  # the optimizer group: Muon's states planned as Muon's; sgd as the model's own
    optimizer = "muon" if group is not None and group.get("name") == "muon" else "adamw"
    return choose_layout(
        spec, machine, batch, precision=cfg.precision.value, seq_len=seq_len, refuses=refuses, optimizer=optimizer
    )


def planning_gpu(accelerator: str) -> Any:
    """The GPU this process plans for (:class:`~lightning_parallel.planning.auto.GPU`), read once; None off CUDA.

    Under torchrun or SLURM every rank plans (no parent of ours runs before them): each reads its own device
    (``LOCAL_RANK``, ``SLURM_LOCALID``), set first, so no rank touches device 0 before Lightning sets its device.
    Otherwise this is the launcher's parent, before any worker starts (or the single process of a one-device run):
    device 0, where rank 0 runs; the workers get the plan in ``cfg.strategy`` and read nothing.
    """
    from lightning_parallel.planning.auto import read_gpu
    from lightning_parallel.recipes.launch import launched_externally

    if accelerator not in ("auto", "gpu", "cuda") or not torch.cuda.is_available():
        return None
    index = 0
    if launched_externally():
        index = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
        torch.cuda.set_device(index)
    return read_gpu(index)
