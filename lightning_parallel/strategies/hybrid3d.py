"""hybrid3d: data x pipeline x tensor parallelism on one (pp, dp, tp) mesh, with ZeRO over dp."""

from __future__ import annotations

from typing import Any

from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.presets import presets_of


class Hybrid3DPreset:
    """The hybrid3d preset under either front door: mixed in before
    :class:`~lightning_parallel.strategies.base.MeshStrategy` (:class:`Hybrid3DStrategy`) or
    :class:`~lightning_parallel.fabric.strategy.MeshFabricStrategy` (Fabric's ``Hybrid3DFabricStrategy``)."""

    strategy_name = "hybrid3d"  # the door's __init__ takes the settings (a ParallelConfig, or its fields by name)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """The names in a registry (the Trainer's or Fabric's: the same ``register``): hybrid3d and its presets."""
        strategy_registry.register("hybrid3d", cls, description="data x pipeline x tensor parallelism", override=True)
        for name, preset in presets_of("hybrid3d").items():
            strategy_registry.register(name, cls, preset.description, override=True, **preset.init_params())


class Hybrid3DStrategy(Hybrid3DPreset, MeshStrategy):
    """Train one LightningModule across any split of the world into (pp, dp, tp).

    Pipeline parallelism cuts the module's ``pipeline_layers()`` into contiguous stages on the pp axis
    and runs them under a ``torch.distributed.pipelining`` schedule; tensor parallelism applies the
    module's ``tensor_parallel_plan()`` (Megatron column/row splits) on the tp axis; data parallelism
    averages gradients over dp, or shards model states there with ``zero_stage`` 1-3 (also together with
    pp). The logged loss is the same on every rank; samplers and ``sync_dist`` use the dp axis.

    ``Hybrid3DStrategy(pp=2, tp=2, zero_stage=1)``, or ``Hybrid3DStrategy(config)`` with a
    :class:`~lightning_parallel.parallel.config.ParallelConfig`.

    Args:
        config: the parallel settings; every field of :class:`ParallelConfig` may also be given by name:
            ``dp`` (``"auto"``: the ranks pp and tp leave), ``pp``, ``tp``, ``zero_stage`` (0-3), ``offload``,
            ``reshard_after_forward``, ``pp_schedule`` (``gpipe``, ``1f1b``, ``interleaved_1f1b``,
            ``zero_bubble``), ``microbatches`` (default 2 * pp), ``pp_balance`` (``uniform``, ``params``,
            ``profile``), ``pp_memory_budget``, ``pp_virtual_stages``, ``sequence_parallel``,
            ``activation_checkpointing`` (``none``, ``full``, ``selective``), ``cp`` (context parallelism: each
            sequence split over cp ranks), ``cp_mode`` (``ring``, ``ulysses``), ``spatial`` (conv nets: each image
            split into strips of rows over the cp axis) and ``dp_shard`` (HSDP: ZeRO over
            dp_shard ranks, replicated across dp / dp_shard replicas; None: over all of dp).
        **kwargs: the settings above, and :class:`~lightning_parallel.strategies.base.MeshStrategy`'s
            (``checkpoint_format``, ``timeout``, ``process_group_backend``, Lightning's).
    """
