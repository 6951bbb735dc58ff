"""The Fabric names of the mesh strategies, equal to the Trainer's: ``Fabric(strategy="zero3")``,
``Fabric(strategy=Hybrid3DFabricStrategy(tp=2))``. The presets are the Trainer's own
(:class:`~lightning_parallel.strategies.zero.ZeroPreset`,
:class:`~lightning_parallel.strategies.hybrid3d.Hybrid3DPreset`: their settings, checks and names) over
:class:`MeshFabricStrategy`."""

from __future__ import annotations

from lightning_parallel.fabric.strategy import MeshFabricStrategy
from lightning_parallel.strategies.hybrid3d import Hybrid3DPreset
from lightning_parallel.strategies.zero import ZeroPreset


class Hybrid3DFabricStrategy(Hybrid3DPreset, MeshFabricStrategy):
    """:class:`~lightning_parallel.strategies.hybrid3d.Hybrid3DStrategy` under Fabric: data x tensor parallelism
    (with sequence parallelism, cp, ep, HSDP's ``dp_shard`` and ZeRO over dp) on one mesh.

    Args:
        config: the parallel settings; every field of :class:`ParallelConfig` may also be given by name
            (``dp``, ``tp``, ``zero_stage``, ``sequence_parallel``, ``cp``, ``ep``, ``dp_shard``, ``pp``,
            ``pp_schedule``, ``microbatches``, ...). Under ``pp`` > 1 the loop runs each batch with
            :meth:`~MeshFabricStrategy.pipeline_step`.
        **kwargs: the settings above, and :class:`MeshFabricStrategy`'s (``timeout``, ``process_group_backend``,
            Fabric's).
    """


class ZeroFabricStrategy(ZeroPreset, MeshFabricStrategy):
    """:class:`~lightning_parallel.strategies.zero.ZeroStrategy` under Fabric: ZeRO stage 1, 2 or 3 over every rank.

    Args:
        stage: 1, 2 or 3.
        offload: keep the sharded states on the host (stages 2 and 3).
        reshard_after_forward: stage 3 only (FSDP2's setting).
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``.
        **kwargs: the other ZeRO settings (``dp_shard``, ``grad_compression``, ...) and :class:`MeshFabricStrategy`'s.
    """


def register_fabric_strategies() -> None:
    """Add the names to Fabric's registry (idempotent; ``import lightning_parallel`` calls it)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for cls in (ZeroFabricStrategy, Hybrid3DFabricStrategy):
        cls.register_strategies(STRATEGY_REGISTRY)
