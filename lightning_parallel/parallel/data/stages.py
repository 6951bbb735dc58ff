"""The ZeRO stages by number and the choice of a sharding: ``zero_stage`` (or a ``zero*`` strategy name) maps to a
registered sharding's name here (:data:`ZERO_NAMES`), and nothing else compares stage numbers; ``sharding`` (a name
in :data:`~lightning_parallel.parallel.data.sharding.SHARDINGS`) picks any registered sharding, variants included.
Importing this module registers the built-in shardings. Pure torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

# imported to register their shardings (register_sharding); a new variant's module is imported here too
from lightning_parallel.parallel.data import flat_sharding, fsdp, replicate  # noqa: F401
from lightning_parallel.parallel.data.sharding import SHARDINGS, DataParallelSharding
from lightning_parallel.parallel.mesh import ParallelMesh

if TYPE_CHECKING:  # config.py imports this module's checks
    from lightning_parallel.parallel.config import ParallelConfig

ZERO_NAMES: dict[int, str] = {0: "replicate", 1: "zero1", 2: "zero2", 3: "zero3"}  # zero_stage -> sharding name
ZERO_STAGES: dict[int, type[DataParallelSharding]] = {stage: SHARDINGS[name] for stage, name in ZERO_NAMES.items()}
OFFLOAD_STAGES = tuple(stage for stage, cls in ZERO_STAGES.items() if cls.supports_offload)


class PlannedStage(int):
    """A registered variant as the planners carry it: its ZeRO stage's number wherever a number decides (message
    counts, ZeRO-3's gathers, ``zero_stage`` in a config), its name where :func:`stage_sharding` looks up the formulas
    (the class attributes ``sharded`` and ``comm_factor``)."""

    sharding: str

    def __new__(cls, name: str) -> PlannedStage:
        stage = super().__new__(cls, SHARDINGS[name].stage)
        stage.sharding = name
        return stage

    def __getnewargs__(self) -> tuple[str]:  # type: ignore[override]  # copies keep the name
        return (self.sharding,)

    def __repr__(self) -> str:
        return self.sharding


def planned_stages() -> list[int]:
    """What the planners weigh: the ZeRO stages 0-3, then each registered sharding declaring ``planned = True``
    (a :class:`PlannedStage`), so a new variant is planned without editing ``planning/``."""
    named = [PlannedStage(name) for name, cls in SHARDINGS.items() if cls.planned and name not in ZERO_NAMES.values()]
    return [*ZERO_STAGES, *named]


def stage_sharding(stage: int) -> type[DataParallelSharding]:
    """The sharding class of a (validated) stage number, or of a :class:`PlannedStage` (the variant it names)."""
    name = getattr(stage, "sharding", None)
    return SHARDINGS[name] if name is not None else ZERO_STAGES[stage]


def sharding_class(config: ParallelConfig) -> type[DataParallelSharding]:
    """The sharding a (validated) config picks: ``config.sharding`` by name, else its ZeRO stage's."""
    return SHARDINGS[config.sharding if config.sharding is not None else ZERO_NAMES[config.zero_stage]]


def check_sharding_name(name: object) -> type[DataParallelSharding]:
    """The registered sharding called ``name``.

    Raises:
        ValueError: naming the registered shardings.
    """
    if not isinstance(name, str) or name not in SHARDINGS:
        raise ValueError(
            f"sharding={name!r} is not a registered sharding: set sharding to one of {', '.join(SHARDINGS)} "
            "(register a new one with @register_sharding), or sharding=None to use zero_stage's."
        )
    return SHARDINGS[name]


def check_zero_settings(stage: object, offload: object, *, name: str = "stage", allow_zero: bool = False) -> None:
    """Validate a ZeRO stage and offload flag before anything starts."""
    stages = [s for s in ZERO_STAGES if allow_zero or s > 0]
    if isinstance(stage, bool) or stage not in stages:
        choices = ", ".join(str(s) for s in stages[:-1]) + f" or {stages[-1]}"
        raise ValueError(f"{name}={stage!r} is not a ZeRO stage: set {name} to {choices}.")
    if not isinstance(offload, bool):
        raise TypeError(f"offload={offload!r} must be True or False: set offload=True or offload=False.")
    if offload and stage not in OFFLOAD_STAGES:
        options = " or ".join(f"{name}={s}" for s in OFFLOAD_STAGES)
        raise ValueError(
            f"offload=True needs sharded gradients, which {name}={stage} does not have (ZeRO-Offload "
            f"builds on stage 2): set {options}, or offload=False."
        )


def make_sharding(
    config: ParallelConfig, mesh: ParallelMesh, setting: str = "", param_dtype: torch.dtype | None = None
) -> DataParallelSharding:
    """The sharding ``config`` picks (:func:`sharding_class`) over the world's ``mesh`` (it picks the roles it
    shards over, the replicas' too under HSDP), with the config's data-parallel settings and the precision's
    ``param_dtype`` (what ZeRO-3 gathers parameters in; None: their own)."""
    return sharding_class(config).from_mesh(
        mesh,
        offload=config.offload,
        reshard_after_forward=config.reshard_after_forward,
        grad_compression=config.grad_compression,
        powersgd_rank=config.powersgd_rank,
        overlap_grad_reduce=config.overlap_grad_reduce,
        bucket_mb=config.bucket_mb,
        param_dtype=param_dtype,
        setting=setting,
    )
