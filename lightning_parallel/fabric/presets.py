"""The Fabric names of the mesh strategies, equal to the Trainer's: ``Fabric(strategy="zero3")``,
``Fabric(strategy=Hybrid3DFabricStrategy(tp=2))``. Presets over :class:`ParallelConfig`, as
:mod:`lightning_parallel.strategies.hybrid3d` and :mod:`lightning_parallel.strategies.zero` are (their checks are
the same functions)."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_parallel.fabric.strategy import MeshFabricStrategy
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.stages import OFFLOAD_STAGES, ZERO_STAGES
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.strategies.zero import check_zero_world, zero_config, zero_setting


class Hybrid3DFabricStrategy(MeshFabricStrategy):
    """:class:`~lightning_parallel.strategies.hybrid3d.Hybrid3DStrategy` under Fabric: data x tensor parallelism
    (with sequence parallelism, cp, ep, HSDP's ``dp_shard`` and ZeRO over dp) on one mesh.

    Args:
        config: the parallel settings; every field of :class:`ParallelConfig` may also be given by name
            (``dp``, ``tp``, ``zero_stage``, ``sequence_parallel``, ``cp``, ``ep``, ``dp_shard``, ...). ``pp`` > 1
            is refused in Fabric for now.
        **kwargs: the settings above, and :class:`MeshFabricStrategy`'s (``timeout``, ``process_group_backend``,
            Fabric's).
    """

    strategy_name = "hybrid3d"

    def __init__(self, config: ParallelConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("hybrid3d", cls, description="data x tensor parallelism (lightning_parallel)")


class ZeroFabricStrategy(MeshFabricStrategy):
    """:class:`~lightning_parallel.strategies.zero.ZeroStrategy` under Fabric: ZeRO stage 1, 2 or 3 over every rank.

    Args:
        stage: 1, 2 or 3.
        offload: keep the sharded states on the host (stages 2 and 3).
        reshard_after_forward: stage 3 only (FSDP2's setting).
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``.
        **kwargs: the other ZeRO settings (``dp_shard``, ``grad_compression``, ...) and :class:`MeshFabricStrategy`'s.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        offload: bool = False,
        reshard_after_forward: bool = True,
        activation_checkpointing: str = "none",
        **kwargs: Any,
    ) -> None:
        config, kwargs = zero_config(
            stage, offload, reshard_after_forward, activation_checkpointing, kwargs, owner=type(self).__name__
        )
        super().__init__(config, **kwargs)

    @override
    def _setting(self) -> str:
        return zero_setting(self.config)

    @override
    def _parallel_degrees(self, world_size: int) -> ParallelDims:
        check_zero_world(self._setting(), world_size)
        return super()._parallel_degrees(world_size)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in ZERO_STAGES:
            if stage:
                strategy_registry.register(f"zero{stage}", cls, description=f"ZeRO stage {stage}", stage=stage)
        for stage in OFFLOAD_STAGES:
            description = f"ZeRO stage {stage}, sharded states on the host"
            strategy_registry.register(f"zero{stage}_offload", cls, description=description, stage=stage, offload=True)


def register_fabric_strategies() -> None:
    """Add the names to Fabric's registry (idempotent; ``import lightning_parallel`` calls it)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for cls in (ZeroFabricStrategy, Hybrid3DFabricStrategy):
        cls.register_strategies(_Overriding(STRATEGY_REGISTRY))


class _Overriding:
    """Fabric's registry, every name registered with ``override=True`` (a second import changes nothing)."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def register(self, name: str, strategy: Any, description: str, **init_params: Any) -> None:
        self.registry.register(name, strategy, description=description, override=True, **init_params)
