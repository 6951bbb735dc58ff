"""What the GPT and VGG recipes share: the strategy from ``strategy=...``, the batch split over dp, the
checks that run before any worker starts, and the Trainer (``metrics.json``: :mod:`.metrics`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from lightning_parallel import AsyncPSStrategy, Hybrid3DStrategy, ZeroStrategy
from lightning_parallel.callbacks.activation import ActivationCheckpointing, ActivationMemoryMonitor
from lightning_parallel.callbacks.moe import MoEAuxLossScale, MoEMonitor
from lightning_parallel.callbacks.monitor import TrainingMonitor
from lightning_parallel.callbacks.preemption import PREEMPTED_FILE, Preemption
from lightning_parallel.callbacks.progress import step_progress_bar
from lightning_parallel.callbacks.resume import ExactResume
from lightning_parallel.parallel.activation_checkpoint import check_activation_checkpointing
from lightning_parallel.parallel.async_ps import protocol
from lightning_parallel.parallel.checkpoint import storage
from lightning_parallel.parallel.checkpoint.files import is_sharded_checkpoint
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.failure import to_timeout
from lightning_parallel.parallel.pipeline.partition import check_stage_count
from lightning_parallel.plugins.float8 import float8_plugin
from lightning_parallel.plugins.precision import cpu_fp16_plugin
from lightning_parallel.recipes.checks import (
    check_checkpoint_settings,
    check_known_keys,
    check_precision,
    check_trainer_settings,
)
from lightning_parallel.recipes.strategy_conf import schema_for
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.checks import checked_before_launch
from lightning_parallel.strategies.zero import ZERO_PRESETS, ZERO_SETTINGS


def parallel_config(conf: DictConfig) -> ParallelConfig:
    """The parallel settings of ``strategy=...`` (the schema's keys and sections, as ParallelConfig's fields)."""
    return ParallelConfig.from_mapping(conf)


ASYNC_PS_KEYS = ("num_servers", "staleness", "slow_worker_sleep", "slow_worker_rank")


def build_async_ps(conf: DictConfig, timeout: dict[str, Any]) -> AsyncPSStrategy:
    """``strategy=async_ps``: parameter servers (its schema has no key of the other strategies)."""
    settings = {k: conf[k] for k in ASYNC_PS_KEYS}
    for key in ("num_servers", "staleness", "slow_worker_sleep"):
        try:
            protocol.check_settings(**{"num_servers": 1, "staleness": 0, key: settings[key]})
        except ValueError as error:
            raise ValueError(f"strategy.{error}") from None
    return AsyncPSStrategy(**settings, **timeout)


def build_strategy(conf: DictConfig) -> Any:
    """The strategy object (or Lightning's name) for ``strategy=...``. The schema of the preset picked
    (:mod:`~lightning_parallel.recipes.strategy_conf`) has only the keys its strategy takes, so Hydra refused the
    others when it composed the config; this refuses the values that cannot run."""
    name = conf.name
    schema = schema_for(name)
    if schema is None or name == "auto":
        raise ValueError(
            f"strategy={name!r} is unknown: use ddp, {', '.join(ZERO_PRESETS)}, hybrid3d or async_ps (conf/strategy/ "
            "lists presets); strategy=auto is resolved to hybrid3d by recipes/train_gpt.py and train_vgg.py "
            "(recipes/auto.py)."
        )
    picked = OmegaConf.get_type(conf)
    if dataclasses.is_dataclass(picked) and not issubclass(picked, schema):  # strategy=auto's resolved: hybrid3d
        raise ValueError(
            f"strategy.name={name} with another strategy's keys ({picked.__qualname__}): pick the preset with "
            f"strategy={name} instead of setting strategy.name."
        )
    config = parallel_config(conf)
    check_activation_checkpointing(config.activation_checkpointing, "strategy.activation_checkpointing")
    timeout_s = conf.get("timeout_s")
    timeout = {} if timeout_s is None else {"timeout": to_timeout(timeout_s, "strategy.timeout_s")}
    if name == "async_ps":
        return build_async_ps(conf, timeout)
    if name == "hybrid3d":
        return Hybrid3DStrategy(config, **timeout)
    if name in ZERO_PRESETS:
        stage, offload = ZERO_PRESETS[name]
        if config.zero_stage not in (0, stage) or (config.offload and not offload):
            raise ValueError(
                f"strategy={name} is ZeRO stage {stage}: pick strategy=zero{config.zero_stage} instead of setting "
                "strategy.zero_stage, or use strategy=hybrid3d with strategy.zero_stage."
            )
        shared = {k: getattr(config, k) for k in ZERO_SETTINGS if k not in ("zero_stage", "offload")}
        return ZeroStrategy(stage=stage, offload=offload, **shared, **timeout)
    return "ddp"  # the one name left (DDPConf); activation checkpointing, if set, comes as a callback (build_trainer)


def world_size(cfg: DictConfig) -> int:
    """Processes in the job: ``trainer.devices`` on each of ``trainer.num_nodes`` nodes."""
    return cfg.trainer.devices * cfg.trainer.num_nodes


def data_parallel_size(conf: DictConfig, world: int, dims: Any = None) -> int:
    """How many different batches one optimizer step sees: the ranks of the mesh's ``batch`` role (``dims``: the
    degrees when known already)."""
    if conf.name == "async_ps":  # the servers see no data
        return protocol.check_world(conf.num_servers, world, "strategy.num_servers")
    if conf.name != "hybrid3d":
        return world
    return (dims or parallel_config(conf).dims(world)).role_size("batch")


def micro_batch_size(cfg: DictConfig, world: int, dims: Any = None) -> int:
    """Samples per dp rank per forward so that one optimizer step sees ``data.global_batch_size``."""
    dp = data_parallel_size(cfg.strategy, world, dims)
    accumulate = cfg.trainer.accumulate_grad_batches
    if cfg.data.global_batch_size < 1:
        raise ValueError(f"data.global_batch_size={cfg.data.global_batch_size} must be positive: samples per step.")
    size, rest = divmod(cfg.data.global_batch_size, dp * accumulate)
    if rest or size <= 0:
        raise ValueError(
            f"data.global_batch_size={cfg.data.global_batch_size} does not split over dp={dp} x "
            f"trainer.accumulate_grad_batches={accumulate}: make it a multiple of {dp * accumulate}."
        )
    return size


def check_run_settings(cfg: DictConfig, num_layers: int) -> Any:
    """The checks every recipe runs before a worker starts; returns the strategy (checked, not yet used).

    Args:
        cfg: the composed recipe config.
        num_layers: how many pipeline layers the model has (``strategy.pp`` stages cut between them).
    """
    check_known_keys(cfg)
    check_trainer_settings(cfg)
    world = world_size(cfg)
    strategy = build_strategy(cfg.strategy)
    _CHECKED[id(cfg.strategy)] = (OmegaConf.to_yaml(cfg.strategy), strategy)  # build_trainer's, in this process
    check_precision(cfg, strategy)
    # hybrid3d: the degrees once, carried by the strategy's runtime from here (mesh_dims, check_strategy_model)
    dims = strategy.runtime.degrees(world) if isinstance(strategy, Hybrid3DStrategy) else None
    micro = micro_batch_size(cfg, world, dims)
    if isinstance(strategy, MeshStrategy):  # tp, cp and HSDP's dp_shard inside a node
        (dims or strategy.config.dims(world)).check_node_size(cfg.trainer.devices, cfg.trainer.num_nodes)
    if isinstance(strategy, Hybrid3DStrategy):
        config = strategy.config
        check_stage_count(num_layers, dims.pp * config.stages_per_rank, f"strategy.pp={dims.pp}")
        if dims.pp > 1 and micro % config.microbatches:
            raise ValueError(
                f"strategy.microbatches={config.microbatches} does not divide the {micro} samples each dp rank "
                f"gets per step (data.global_batch_size={cfg.data.global_batch_size} over dp={dims.dp}): "
                "pick a divisor of it or change data.global_batch_size."
            )
    elif isinstance(strategy, AsyncPSStrategy):
        if cfg.precision.value not in ("32-true", "bf16-mixed"):
            raise ValueError(
                f"precision={cfg.precision.value} is not supported by strategy=async_ps (the servers apply fp32 "
                "gradients as they come, with no loss scaling): use precision=32-true or precision=bf16-mixed."
            )
        if cfg.trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"trainer.accumulate_grad_batches={cfg.trainer.accumulate_grad_batches} is not supported by "
                "strategy=async_ps (a push is one batch's gradient): set it to 1 and raise data.global_batch_size."
            )
        if strategy.slow_worker_rank is not None and not 0 <= strategy.slow_worker_rank < world - strategy.num_servers:
            raise ValueError(
                f"strategy.slow_worker_rank={strategy.slow_worker_rank} is not a worker: workers are ranks 0.."
                f"{world - strategy.num_servers - 1}; pick one of them or null (the last worker)."
            )
    elif world < 2 and strategy != "ddp":
        raise ValueError(f"strategy={cfg.strategy.name} shards over processes: set trainer.devices to 2 or more.")
    check_checkpoint_settings(cfg)
    if cfg.checkpoint.async_save and not isinstance(strategy, MeshStrategy):
        raise ValueError(
            f"checkpoint.async_save=true writes our sharded folders: strategy={cfg.strategy.name} does not write "
            "them. Use strategy=zero1..3 or hybrid3d, or drop checkpoint.async_save."
        )
    return strategy


def mesh_dims(cfg: DictConfig, strategy: Any) -> Any:
    """The hybrid3d layout's degrees (:class:`~lightning_parallel.parallel.mesh.ParallelDims`); None under the other
    strategies (they split data only)."""
    if not isinstance(strategy, Hybrid3DStrategy):
        return None
    return strategy.runtime.dims or strategy.runtime.degrees(world_size(cfg))  # check_run_settings's, carried


# how the recipe names the settings the strategy's check names by their ParallelConfig and LoraConfig names
RECIPE_NAMES = {axis: f"strategy.{axis}" for axis in ("pp", "tp", "cp", "ep", "spatial")}
LORA_NAMES = {"target_modules": "peft.target_modules", "lora_dropout": "peft.dropout", "lora_r": "peft.r"}


def check_strategy_model(cfg: DictConfig, strategy: Any, module: Any, lora: bool = False) -> None:
    """The strategy's one check of ``module`` (built on meta, as the workers will train it) against its layout,
    before any worker starts (:func:`~lightning_parallel.strategies.checks.check_model`); its message names the
    settings as the recipe calls them. The workers do not repeat it (:func:`skip_worker_check`).

    Raises:
        ValueError, TypeError: naming the setting and the fix.
    """
    if isinstance(strategy, MeshStrategy):  # ddp and async_ps: every rank holds the whole model
        with recipe_names(lora):  # the job's degrees: the strategy knows its world size once the Trainer has it
            dims = strategy.runtime.dims or strategy.config.dims(world_size(cfg))  # hybrid3d: check_run_settings's
            strategy.runtime.check(module, dims)


@contextmanager
def recipe_names(lora: bool = False) -> Iterator[None]:
    """A ValueError or TypeError raised inside, with the recipe's names of the settings it names added."""
    try:
        yield
    except (ValueError, TypeError) as err:
        names = (LORA_NAMES if lora else {}) | RECIPE_NAMES
        named = [f"{name} is {key}" for name, key in names.items() if re.search(rf"\b{name}\b", str(err))]
        kind = ValueError if isinstance(err, ValueError) else TypeError
        raise kind(f"{err}" + (f" (in the recipe: {', '.join(named)})" if named else "")) from None


def skip_worker_check(trainer: pl.Trainer, model: Any) -> None:
    """In a recipe's worker: ``model``'s layout was checked before launch (:func:`check_strategy_model`, run by the
    recipe's ``check_config`` in the parent, or in this process under torchrun), so fit does not check it again."""
    if isinstance(trainer.strategy, MeshStrategy):
        checked_before_launch(model, trainer.strategy.config)


# id(cfg.strategy) -> (its YAML, the strategy check_run_settings built from it): a run in one process (one device,
# torchrun, SLURM's tasks) builds its strategy once; spawned workers build theirs from the config they receive
_CHECKED: dict[int, tuple[str, Any]] = {}


def checked_strategy(conf: DictConfig) -> Any:
    """The strategy :func:`check_run_settings` built from this ``strategy`` config in this process (taken once,
    unchanged since), else :func:`build_strategy`'s."""
    kept = _CHECKED.pop(id(conf), None)
    return kept[1] if kept is not None and kept[0] == OmegaConf.to_yaml(conf) else build_strategy(conf)


def build_trainer(cfg: DictConfig, run_dir: Path, **kwargs: Any) -> pl.Trainer:
    """The Trainer the recipe's ``trainer``, ``precision`` and ``checkpoint`` groups describe."""
    t = cfg.trainer
    o = cfg.observability
    monitor = TrainingMonitor(
        t.log_every_n_steps, measure_step=o.measure_step, timeline_dir=run_dir if o.timeline else None
    )
    strategy = checked_strategy(cfg.strategy)
    if cfg.checkpoint.async_save:  # checked before launch (check_run_settings): one of our strategies
        strategy.async_save = True
    callbacks: list[pl.Callback] = [*kwargs.pop("callbacks", [])]
    if not isinstance(strategy, AsyncPSStrategy):  # these run collectives over the whole world after every step
        callbacks += [monitor, ExactResume(), MoEAuxLossScale(), MoEMonitor()]  # MoE: nothing to do when dense
        callbacks.append(Preemption(cfg.checkpoint.dir, marker=run_dir / PREEMPTED_FILE))  # SIGTERM: save last, stop
    # after the TrainingMonitor: both enter dispatch modes at a batch's start, and torch pops modes from the top
    # of one stack, so the activation counter (entered last) must be the first to leave (before backward)
    callbacks.append(ActivationMemoryMonitor())
    if t.enable_progress_bar:  # the step out of max_steps and the loss, not "Epoch 0/-2" and v_num
        callbacks.append(step_progress_bar())
    if strategy == "ddp" and cfg.strategy.activation_checkpointing != "none":
        callbacks.append(ActivationCheckpointing(cfg.strategy.activation_checkpointing))  # Lightning's own ddp
    if cfg.checkpoint.dir:
        c = cfg.checkpoint
        # monitor "step", highest first: keeps the newest keep_last checkpoints (plus last.ckpt)
        callbacks.append(
            ModelCheckpoint(
                dirpath=c.dir,
                every_n_train_steps=c.every_n_steps,
                save_last=True,
                monitor="step",
                mode="max",
                save_top_k=c.keep_last,
                # a step saved again after a restart replaces its folder instead of adding "-v1" beside it
                enable_version_counter=False,
            )
        )
    precision, plugins = cfg.precision.value, list(kwargs.pop("plugins", None) or [])
    fp16 = cpu_fp16_plugin(precision, t.accelerator) if isinstance(strategy, MeshStrategy) else None
    if fp16 is not None:  # 16-mixed on CPU: fp16 autocast asked for explicitly (Lightning alone would run bf16)
        precision, plugins = None, [*plugins, fp16]
    if precision == "fp8":  # torchao float8 over bf16-mixed (plugins/float8.py)
        precision, plugins = None, [*plugins, float8_plugin(cfg.precision, t.accelerator)]
    return pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        precision=precision,
        plugins=plugins or None,
        max_steps=t.max_steps,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=min(t.val_check_interval, t.max_steps),
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        gradient_clip_val=t.gradient_clip_val,
        accumulate_grad_batches=t.accumulate_grad_batches,
        enable_progress_bar=t.enable_progress_bar,
        enable_checkpointing=bool(cfg.checkpoint.dir),
        logger=_logger(t.logger, run_dir),
        callbacks=callbacks,
        use_distributed_sampler=False,  # the data modules split each global batch over the dp axis themselves
        num_sanity_val_steps=0,
        **kwargs,
    )


def resume_path(cfg: DictConfig) -> str | None:
    """``ckpt_path`` for ``trainer.fit``: with ``checkpoint.dir`` a URL, ``last`` is its ``last.ckpt`` (Lightning's
    own lookup drops the URL's scheme); None, as Lightning does for a local folder, when there is none yet."""
    if cfg.ckpt_path != "last" or not storage.has_scheme(cfg.checkpoint.dir):
        return cfg.ckpt_path
    last = storage.join(cfg.checkpoint.dir, "last.ckpt")
    return str(last) if is_sharded_checkpoint(last) else None


def _logger(kind: str, run_dir: Path) -> Any:
    if kind == "csv":
        return CSVLogger(run_dir, name="logs")
    if kind == "tensorboard":
        return TensorBoardLogger(run_dir, name="tb")
    if kind == "none":
        return False
    raise ValueError(f"trainer.logger={kind!r} is unknown: use csv, tensorboard or none.")


def sampler_kwargs(trainer: pl.Trainer) -> dict[str, int]:
    """``num_replicas`` and ``rank`` along the dp axis: pp and tp ranks of one dp rank read the same samples."""
    return getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
