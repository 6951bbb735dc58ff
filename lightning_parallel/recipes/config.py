"""Config schemas of the recipes, registered in Hydra's ConfigStore.

Every YAML file under ``conf/<group>/`` starts from the group's schema here, so a misspelled key or a value
of the wrong type fails when Hydra composes the config, before anything is launched. The keys are the
stable CLI of the recipes (listed in shared/DESIGN.md): ``trainer.devices``, ``trainer.max_steps``,
``strategy.dp|pp|tp|zero_stage|pp_schedule|microbatches``, ``precision=...``, ``data.global_batch_size``,
``seed``, ``checkpoint.dir``, ``checkpoint.every_n_steps``, ``ckpt_path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class StrategyConf:
    """One schema for every strategy, so the same keys work whichever is picked."""

    name: str = "ddp"  # ddp, zero1, zero2, zero3, zero2_offload, zero3_offload or hybrid3d
    dp: Any = "auto"  # an int or "auto"
    pp: int = 1
    tp: int = 1
    zero_stage: int = 0
    offload: bool = False
    pp_schedule: str = "1f1b"
    microbatches: int | None = None
    pp_balance: str = "uniform"
    pp_virtual_stages: int | None = None
    sequence_parallel: bool = False


@dataclass
class PrecisionConf:
    value: str = "32-true"  # Lightning's precision flag


@dataclass
class GPTModelConf:
    vocab_size: int = 256  # byte-level tokens
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 0


@dataclass
class TextDataConf:
    kind: str = "text"  # "text": bytes of a UTF-8 file; "tokens": a pre-tokenized file of uint16 ids
    path: str | None = None  # None: a corpus built from text that ships with Python
    global_batch_size: int = 32  # samples per optimizer step, whatever the layout
    val_fraction: float = 0.05
    num_workers: int = 0


@dataclass
class TrainerConf:
    devices: int = 1
    accelerator: str = "cpu"
    max_steps: int = 200
    log_every_n_steps: int = 10
    val_check_interval: int = 100
    limit_val_batches: int = 8
    gradient_clip_val: float | None = 1.0
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True
    logger: str = "csv"  # csv, tensorboard or none


@dataclass
class CheckpointConf:
    dir: str | None = None  # None: no periodic checkpoints
    every_n_steps: int = 0


@dataclass
class GPTRecipeConf:
    """The GPT recipe's root; conf/train_gpt.yaml picks each group's option."""

    strategy: StrategyConf = MISSING
    precision: PrecisionConf = MISSING
    model: GPTModelConf = MISSING
    data: TextDataConf = MISSING
    trainer: TrainerConf = MISSING
    checkpoint: CheckpointConf = MISSING
    seed: int = 0
    ckpt_path: str | None = None
    sample_tokens: int = 200  # generated at the end of training; 0 for none


SCHEMAS = {
    "strategy": StrategyConf,
    "precision": PrecisionConf,
    "model": GPTModelConf,
    "data": TextDataConf,
    "trainer": TrainerConf,
    "checkpoint": CheckpointConf,
}


def register_configs() -> None:
    """Store each group's schema as ``<group>/schema`` (the YAML files extend it) and the recipe's root."""
    cs = ConfigStore.instance()
    for group, schema in SCHEMAS.items():
        cs.store(group=group, name="schema", node=schema)
    cs.store(name="gpt_schema", node=GPTRecipeConf)
