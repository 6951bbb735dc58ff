"""Recipe settings refused before any worker starts: keys no schema has, trainer counts that cannot run,
precisions a strategy refuses, checkpoint settings that would save nothing or resume from nothing.

Each check raises a ValueError (FileNotFoundError for paths) naming the ``group.key=value`` and the fix;
``check_run_settings`` in :mod:`lightning_parallel.recipes.common` calls them in the parent process.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.checkpoint import check_checkpoint_path
from lightning_parallel.parallel.checkpoint import storage
from lightning_parallel.parallel.checkpoint.storage import check_storage
from lightning_parallel.plugins.precision import SUPPORTED_PRECISION

LOGGERS = ("csv", "tensorboard", "none")


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse keys that no schema has: ``+strategy.foo=1`` composes (``+`` adds keys) but nothing reads it."""
    nodes, seen = [("", cfg)], 0
    while seen < len(nodes):  # the root, its groups and their sections
        prefix, node = nodes[seen]
        seen += 1
        nodes += [(f"{prefix}{k}.", v) for k, v in node.items_ex(resolve=False) if isinstance(v, DictConfig)]
    for prefix, node in nodes:
        schema = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(schema):
            continue
        known = [f.name for f in dataclasses.fields(schema)]
        extra = [k for k in node if k not in known]
        if extra:
            raise ValueError(
                f"{prefix}{extra[0]} is not a setting of the recipe (the {prefix.rstrip('.') or 'top-level'} keys "
                f"are {', '.join(known)}): remove the override or fix its spelling."
            )


def check_trainer_settings(cfg: DictConfig) -> None:
    """Counts that must be at least 1 (or 0), the logger and the accelerator's name."""
    t = cfg.trainer
    for key, least in [
        ("devices", 1),
        ("num_nodes", 1),
        ("max_steps", 1),
        ("accumulate_grad_batches", 1),
        ("val_check_interval", 1),
        ("log_every_n_steps", 1),
        ("limit_val_batches", 0),
    ]:
        if t[key] < least:
            raise ValueError(f"trainer.{key}={t[key]} is not allowed: set trainer.{key} to {least} or more.")
    if t.gradient_clip_val is not None and t.gradient_clip_val < 0:
        raise ValueError(
            f"trainer.gradient_clip_val={t.gradient_clip_val} is negative: set a positive norm (null: no clipping)."
        )
    if t.logger not in LOGGERS:
        raise ValueError(f"trainer.logger={t.logger!r} is unknown: use one of {', '.join(LOGGERS)}.")
    from lightning.pytorch.accelerators import AcceleratorRegistry

    accelerators = sorted({*AcceleratorRegistry.available_accelerators(), "gpu", "auto"})
    if t.accelerator not in accelerators:
        raise ValueError(f"trainer.accelerator={t.accelerator!r} is unknown: use one of {', '.join(accelerators)}.")


def check_precision(cfg: DictConfig, strategy: Any) -> None:
    """Our strategies take the four precisions of conf/precision/; Lightning's ddp takes its own list."""
    value = cfg.precision.value
    if strategy == "ddp":
        try:  # Lightning's own list (a private name: if it moves, Lightning checks the value in the workers)
            from lightning.fabric.connector import _PRECISION_INPUT_STR
        except ImportError:
            return
        choices = typing.get_args(_PRECISION_INPUT_STR)
    else:
        choices = SUPPORTED_PRECISION + (("fp8",) if hasattr(strategy, "config") else ())
    if value == "fp8" and value in choices:
        check_fp8(cfg, strategy)
    if value not in choices:
        raise ValueError(
            f"precision.value={value!r} is not supported by strategy={cfg.strategy.name}: use precision= one of "
            f"{', '.join(choices)}."
        )


def check_fp8(cfg: DictConfig, strategy: Any) -> None:
    """``precision=fp8``: its keys, and what they cannot do under the layout (before any worker starts)."""
    from lightning_parallel.parallel.float8 import Float8Settings

    p = cfg.precision
    settings = Float8Settings(str(p.recipe), bool(p.fsdp_float8_all_gather), emulate=p.emulate)
    settings.check_layout(tp=strategy.config.tp, zero_stage=strategy.config.zero_stage)


def check_checkpoint_settings(cfg: DictConfig) -> None:
    """Periodic saves that would save something, and a ``ckpt_path`` that can be resumed from."""
    c = cfg.checkpoint
    if c.dir and c.every_n_steps <= 0:
        raise ValueError(
            f"checkpoint.dir={c.dir!r} with checkpoint.every_n_steps={c.every_n_steps} would save nothing: set "
            "checkpoint.every_n_steps to a positive step count."
        )
    if c.dir and (c.keep_last == 0 or c.keep_last < -1):
        raise ValueError(
            f"checkpoint.keep_last={c.keep_last} keeps no step checkpoints: set it to 1 or more (-1 keeps all)."
        )
    if c.async_save and not c.dir:
        raise ValueError("checkpoint.async_save=true has nothing to save: add checkpoint=periodic (checkpoint.dir).")
    if cfg.ckpt_path == "last" and not c.dir:
        raise ValueError("ckpt_path=last looks in checkpoint.dir, which is not set: add checkpoint=periodic.")
    restarts = cfg.get("max_restarts") or 0
    if restarts < 0:
        raise ValueError(f"max_restarts={restarts}: give 0 (no restart) or the most restarts a run may take.")
    if restarts and not c.dir:
        raise ValueError(
            f"max_restarts={restarts} restarts from the newest checkpoint in checkpoint.dir, which is not set: add "
            "checkpoint=periodic (a restart would otherwise begin again at step 0)."
        )
    if c.dir:
        check_storage(c.dir, "checkpoint.dir")
    if storage.has_scheme(cfg.ckpt_path):
        check_storage(cfg.ckpt_path, "ckpt_path")
    elif cfg.ckpt_path not in (None, "last"):
        check_checkpoint_path(cfg.ckpt_path, "ckpt_path")
