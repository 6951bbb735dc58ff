"""The recipes' ``strategy`` schemas: one per strategy, registered in Hydra's ConfigStore (``conf/strategy/*.yaml``
each extends its strategy's), so that a key the chosen strategy does not take is refused when Hydra composes the
config, before anything is launched.

The degrees and the stable keys are top-level (``strategy.tp=2``, ``strategy.pp_schedule=zero_bubble``; sweeps over
them unchanged); the other settings sit in sections (``strategy.pipeline.balance``, ``strategy.sharding.offload``,
``strategy.torchft.replicas``): :data:`~lightning_parallel.parallel.config.SECTIONS` maps each to its
:class:`~lightning_parallel.parallel.config.ParallelConfig` field, whose type, default and description it shares
(tests/test_strategy_reference.py checks they agree). OmegaConf names a schema in its refusal (``Key 'pp' not in
'<name>'``): each schema's name lists its keys and says which strategy takes the others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.sections import recipe_key
from lightning_parallel.strategies.zero import ZERO_PRESETS

KEYS_PAGE = "docs/reference/strategy-keys.md lists each strategy's keys"


def refusing(what: str, fix: str) -> Any:
    """Name a schema for OmegaConf's refusal of a key it lacks: ``Key 'pp' not in '<what> (<its keys>): <fix>'``
    (its ``__qualname__``, which pickling and ``repr`` use, stays the class's)."""

    def name(cls: type) -> type:
        keys = ", ".join(f.name for f in dataclasses.fields(cls))
        cls.__name__ = f"{what} ({keys}): {fix}"
        return cls

    return name


@refusing("the keys of strategy.pipeline", f"with strategy=hybrid3d and pp > 1; {KEYS_PAGE}")
@dataclass
class PipelineConf:
    balance: str = ParallelConfig.pp_balance
    memory_budget: int | None = ParallelConfig.pp_memory_budget
    virtual_stages: int | None = ParallelConfig.pp_virtual_stages


@refusing("the keys of strategy.tensor", f"with strategy=hybrid3d and tp > 1; {KEYS_PAGE}")
@dataclass
class TensorConf:
    sequence_parallel: bool = ParallelConfig.sequence_parallel


@refusing("the keys of strategy.context", f"with strategy=hybrid3d and cp > 1; {KEYS_PAGE}")
@dataclass
class ContextConf:
    mode: str = ParallelConfig.cp_mode


@refusing("the keys of strategy.sharding", f"with strategy=zero1..3 or hybrid3d; {KEYS_PAGE}")
@dataclass
class ShardingConf:
    name: str | None = ParallelConfig.sharding
    offload: bool = ParallelConfig.offload
    reshard_after_forward: bool = ParallelConfig.reshard_after_forward


@refusing("the keys of strategy.grad_reduce", f"with strategy=zero1..3 or hybrid3d; {KEYS_PAGE}")
@dataclass
class GradReduceConf:
    powersgd_rank: int = ParallelConfig.powersgd_rank
    overlap: bool = ParallelConfig.overlap_grad_reduce
    bucket_mb: float = ParallelConfig.bucket_mb


@refusing("the keys of strategy.torchft", f"with strategy=hybrid3d and strategy.fault_tolerance=torchft; {KEYS_PAGE}")
@dataclass
class TorchFTConf:
    replicas: int = ParallelConfig.ft_replicas
    replica_id: int = ParallelConfig.ft_replica_id
    min_replicas: int = ParallelConfig.ft_min_replicas
    lighthouse: str | None = ParallelConfig.ft_lighthouse
    timeout: float = ParallelConfig.ft_timeout


@refusing(
    "the keys of strategy=ddp",
    f"set strategy=zero1..3 for sharding keys, strategy=hybrid3d for degrees and sections; {KEYS_PAGE}",
)
@dataclass
class DDPConf:
    """``strategy=ddp``: Lightning's own DistributedDataParallel (activation checkpointing comes as a callback).

    Attributes:
        name: the strategy: ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``, ``zero3_offload``,
            ``hybrid3d``, ``async_ps``, or ``auto`` (the planner's ``hybrid3d`` layout for the job). Picked with the
            config group (``strategy=zero3``), which also picks the schema of the strategy's keys.
    """

    name: str = "ddp"
    activation_checkpointing: str = ParallelConfig.activation_checkpointing


@refusing(
    "the keys of strategy=zero1..3",
    "set strategy=hybrid3d for pp, tp, cp, ep, spatial, microbatches, pp_schedule, fault_tolerance and the pipeline, "
    f"tensor, context and torchft sections, strategy=async_ps for num_servers and staleness; {KEYS_PAGE}",
)
@dataclass
class ZeroConf:
    """``strategy=zero1|zero2|zero3|zero2_offload|zero3_offload``: data parallelism with ZeRO's sharding.

    Attributes:
        timeout_s: seconds a collective waits for its peers; when a rank fails the others end within it, naming
            the rank (None: torch's default, 30 minutes).
    """

    name: str = "zero1"
    timeout_s: float | None = None
    zero_stage: int = ParallelConfig.zero_stage
    dp_shard: int | None = ParallelConfig.dp_shard
    activation_checkpointing: str = ParallelConfig.activation_checkpointing
    grad_compression: str = ParallelConfig.grad_compression
    compile: bool = ParallelConfig.compile
    sharding: ShardingConf = field(default_factory=ShardingConf)
    grad_reduce: GradReduceConf = field(default_factory=GradReduceConf)


@refusing(
    "the keys of strategy=hybrid3d",
    f"set strategy=async_ps for num_servers and staleness, strategy=auto for simulate and auto_device_memory; "
    f"{KEYS_PAGE}",
)
@dataclass
class Hybrid3DConf:
    """``strategy=hybrid3d``: data x pipeline x tensor x context x expert parallelism and ZeRO on one mesh."""

    name: str = "hybrid3d"
    timeout_s: float | None = None
    dp: Any = ParallelConfig.dp
    pp: int = ParallelConfig.pp
    tp: int = ParallelConfig.tp
    ep: int = ParallelConfig.ep
    cp: int = ParallelConfig.cp
    spatial: int = ParallelConfig.spatial
    dp_shard: int | None = ParallelConfig.dp_shard
    zero_stage: int = ParallelConfig.zero_stage
    pp_schedule: str = ParallelConfig.pp_schedule
    microbatches: int | None = ParallelConfig.microbatches
    activation_checkpointing: str = ParallelConfig.activation_checkpointing
    grad_compression: str = ParallelConfig.grad_compression
    compile: bool = ParallelConfig.compile
    fault_tolerance: str = ParallelConfig.fault_tolerance
    pipeline: PipelineConf = field(default_factory=PipelineConf)
    tensor: TensorConf = field(default_factory=TensorConf)
    context: ContextConf = field(default_factory=ContextConf)
    sharding: ShardingConf = field(default_factory=ShardingConf)
    grad_reduce: GradReduceConf = field(default_factory=GradReduceConf)
    torchft: TorchFTConf = field(default_factory=TorchFTConf)


@refusing("the keys of strategy=auto", f"set strategy=async_ps for num_servers and staleness; {KEYS_PAGE}")
@dataclass
class AutoConf(Hybrid3DConf):
    """``strategy=auto``: the planner's ``hybrid3d`` layout for the job, chosen before launch.

    Attributes:
        auto_device_memory: memory per device to plan for (``80GB``; None: the CUDA device's, else the host's
            memory shared by its processes).
        simulate: simulate the pick before launch (the real ``parallelize()`` and training steps on fake tensors
            at the full world size, docs/simulate.md) and refuse it, with the figures, when a rank's peak memory
            exceeds the device's or a group's ranks issue different collectives.
        planned: set by the recipe, not by hand: the chosen layout and its predicted figures (metrics.json's
            ``planned``).
    """

    name: str = "auto"
    auto_device_memory: str | None = None
    simulate: bool = False
    planned: dict[str, Any] = field(default_factory=dict)


@refusing(
    "the keys of strategy=async_ps",
    f"its workers each hold the whole model: set strategy=zero1..3 or hybrid3d for the others; {KEYS_PAGE}",
)
@dataclass
class AsyncPSConf:
    """``strategy=async_ps``: parameter servers on the last ranks, workers on the others.

    Attributes:
        num_servers: how many ranks (the last ones) hold the parameters; the others are workers.
        staleness: 0 is synchronous (the same training as one process); s > 0 lets a worker run up to s steps ahead
            of the slowest.
        slow_worker_sleep: seconds one worker sleeps in every step (a slowed worker, for tests and benchmarks).
        slow_worker_rank: the slowed worker's rank (None: the last worker).
    """

    name: str = "async_ps"
    timeout_s: float | None = None
    num_servers: int = 1
    staleness: int = 0
    slow_worker_sleep: float = 0.0
    slow_worker_rank: int | None = None


# the schema of each strategy=NAME; conf/strategy/NAME.yaml extends "<key>_schema"
STRATEGY_SCHEMAS: dict[str, type] = {
    "hybrid3d": Hybrid3DConf,
    "auto": AutoConf,
    "zero": ZeroConf,
    "ddp": DDPConf,
    "async_ps": AsyncPSConf,
}


def schema_for(name: str) -> type | None:
    """The schema of ``strategy.name=name`` (the ZeRO presets share one); None for a name no strategy has."""
    return STRATEGY_SCHEMAS.get("zero" if name in ZERO_PRESETS else name) if name != "zero" else None


def strategy_conf(name: str, **settings: Any) -> DictConfig:
    """A ``strategy`` node as Hydra composes it for ``strategy=name`` with ``settings`` by their flat
    :class:`~lightning_parallel.parallel.config.ParallelConfig` names (``pp_balance=...`` goes to
    ``pipeline.balance``) or the schema's own top-level keys; a key the schema lacks is refused as Hydra refuses it."""
    schema = schema_for(name)
    if schema is None:
        raise ValueError(f"strategy={name!r} is unknown: use one of {', '.join(STRATEGY_SCHEMAS)} (or zero1..3).")
    conf = OmegaConf.structured(schema(name=name))
    for key, value in settings.items():
        path = recipe_key(key)
        OmegaConf.update(conf, path, value, merge=False)
    return conf
