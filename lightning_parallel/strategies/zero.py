"""ZeRO stages 1, 2 and 3 (with offload) over the data-parallel ranks: a preset of the mesh strategy."""

from __future__ import annotations

from typing import Any

from lightning_parallel.parallel.config import ParallelConfig, check_flag
from lightning_parallel.parallel.data.stages import OFFLOAD_STAGES, ZERO_STAGES, check_zero_settings
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.presets import presets_of

# the ParallelConfig settings a ZeRO strategy takes; the others (pp, tp, ...) need hybrid3d
ZERO_SETTINGS = (
    "zero_stage",
    "sharding",  # a registered variant of the preset's stage (ParallelConfig checks they agree)
    "dp_shard",
    "offload",
    "reshard_after_forward",
    "activation_checkpointing",
    "grad_compression",
    "powersgd_rank",
    "overlap_grad_reduce",
    "bucket_mb",
    "compile",
)

# the ZeRO presets by name: (stage, offload), from the table of stages; registered in Lightning's registries
# (register_strategies) and read by the recipes' strategy=... (the one list of them)
ZERO_PRESETS: dict[str, tuple[int, bool]] = {f"zero{stage}": (stage, False) for stage in ZERO_STAGES if stage > 0}
ZERO_PRESETS |= {f"zero{stage}_offload": (stage, True) for stage in OFFLOAD_STAGES}


class ZeroPreset:
    """The ZeRO preset under either front door: mixed in before
    :class:`~lightning_parallel.strategies.base.MeshStrategy` (the Trainer's :class:`ZeroStrategy`) or
    :class:`~lightning_parallel.fabric.strategy.MeshFabricStrategy` (Fabric's ``ZeroFabricStrategy``)."""

    strategy_name = "zero"
    config: ParallelConfig

    def __init__(
        self,
        stage: int = 2,
        offload: bool = False,
        reshard_after_forward: bool = True,
        activation_checkpointing: str = "none",
        **kwargs: Any,
    ) -> None:
        settings, kwargs = ParallelConfig.split_kwargs(kwargs)
        refused = sorted(set(settings) - set(ZERO_SETTINGS))
        if refused or "zero_stage" in settings:
            raise TypeError(
                f"{type(self).__name__} does not take {', '.join(refused or ['zero_stage'])}: it only shards data "
                f"(its stage is `stage`). Use {type(self).__name__.replace('Zero', 'Hybrid3D')}(zero_stage=...) to "
                "combine ZeRO with pipeline or tensor parallelism."
            )
        check_zero_settings(stage, offload)
        check_flag("reshard_after_forward", reshard_after_forward)
        config = ParallelConfig(
            zero_stage=stage,
            offload=offload,
            reshard_after_forward=reshard_after_forward,
            activation_checkpointing=activation_checkpointing,
            **settings,
        )
        super().__init__(config, **kwargs)  # type: ignore[call-arg]
        self._name_layout()

    @property
    def stage(self) -> int:
        return self.config.zero_stage

    @property
    def offload(self) -> bool:
        return self.config.offload

    def _name_layout(self) -> None:
        """Messages name the preset (``strategy='zero2'``); one process is refused (nothing to shard over)."""
        self.runtime.label = f"strategy='zero{self.stage}{'_offload' if self.offload else ''}'"
        self.runtime.check_world = self._check_world

    def _check_world(self, world_size: int) -> None:
        if world_size < 2:
            raise ValueError(
                f"{self.runtime.setting()} shards over data-parallel processes but the world size is {world_size}: "
                "set devices (or num_nodes) so there are at least 2 processes, "
                "or use strategy='auto' for one."
            )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """The names in a registry (the Trainer's or Fabric's: the same ``register``)."""
        for name, (stage, offload) in ZERO_PRESETS.items():
            if offload:
                description = f"ZeRO stage {stage} with the sharded states on the host"
                strategy_registry.register(name, cls, description=description, override=True, stage=stage, offload=True)
            else:
                description = f"ZeRO stage {stage}: {ZERO_STAGES[stage].summary}"
                strategy_registry.register(name, cls, description=description, override=True, stage=stage)
        for name, preset in presets_of("zero").items():
            strategy_registry.register(name, cls, preset.description, override=True, **preset.init_params())


class ZeroStrategy(ZeroPreset, MeshStrategy):
    """ZeRO data parallelism: every rank trains on its own batch, model states are sharded.

    Stage 1 shards optimizer states, stage 2 also gradients, stage 3 also parameters (with torch's
    FSDP2). The user's ``configure_optimizers`` stays ordinary (AdamW, SGD, ...); the strategy shards it.
    Checkpoints are sharded folders under single-process names, so they resume at any world size and layout.

    Args:
        stage: 1, 2 or 3.
        offload: keep the sharded states on the host and step the optimizer there (stages 2 and 3).
        reshard_after_forward: stage 3 only: free gathered parameters after each unit's forward (less
            memory) or keep them until backward (less communication).
        activation_checkpointing: ``"none"``, ``"full"`` (recompute each layer in backward, keep only its input)
            or ``"selective"`` (keep matmul, conv and attention outputs, recompute the rest). The layers are the
            module's ``pipeline_layers()`` if it has them, else its repeated blocks.
        **kwargs: the other ParallelConfig settings a ZeRO layout has (:data:`ZERO_SETTINGS`:
            ``dp_shard`` (HSDP: shard over dp_shard ranks, replicate across dp / dp_shard), ``grad_compression``,
            ``powersgd_rank``, ``overlap_grad_reduce``, ``bucket_mb``, ``compile``; any other setting (pp, tp,
            ...) is refused with the fix), and Lightning's arguments, passed to
            :class:`~lightning_parallel.strategies.base.MeshStrategy` (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``process_group_backend``, ``timeout``, ``checkpoint_format``, ...).
    """
