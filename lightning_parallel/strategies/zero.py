"""ZeRO stages 1, 2 and 3 (with offload) as a Lightning strategy over the data-parallel ranks."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_parallel.mesh import ParallelDims
from lightning_parallel.strategies.base import MeshStrategy

ZERO_STAGES = (1, 2, 3)
OFFLOAD_STAGES = (2, 3)


def check_zero_settings(stage: object, offload: object, *, stages=ZERO_STAGES, name: str = "stage") -> None:
    """Validate a ZeRO stage and offload flag before anything starts."""
    if isinstance(stage, bool) or stage not in stages:
        choices = ", ".join(str(s) for s in stages[:-1]) + f" or {stages[-1]}"
        raise ValueError(f"{name}={stage!r} is not a ZeRO stage: set {name} to {choices}.")
    check_flag("offload", offload)
    if offload and stage not in OFFLOAD_STAGES:
        raise ValueError(
            f"offload=True needs sharded gradients, which {name}={stage} does not have (ZeRO-Offload "
            f"builds on stage 2): set {name}=2 or {name}=3, or offload=False."
        )


def check_flag(name: str, value: object) -> None:
    """A boolean setting: refuse anything else (a string such as "false" would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False: set {name}=True or {name}=False.")


class ZeroStrategy(MeshStrategy):
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
        **kwargs: passed to :class:`~lightning_parallel.strategies.base.MeshStrategy`
            (``accelerator``, ``parallel_devices``, ``cluster_environment``, ``process_group_backend``,
            ``timeout``, ...).
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        offload: bool = False,
        reshard_after_forward: bool = True,
        activation_checkpointing: str = "none",
        **kwargs: Any,
    ):
        check_zero_settings(stage, offload)
        check_flag("reshard_after_forward", reshard_after_forward)
        if stage != 3 and not reshard_after_forward:
            rank_zero_warn("reshard_after_forward only applies with stage=3: ignored.")
        super().__init__(
            zero_stage=stage,
            offload=offload,
            reshard_after_forward=reshard_after_forward,
            activation_checkpointing=activation_checkpointing,
            **kwargs,
        )

    @property
    def stage(self) -> int:
        return self.zero_stage

    @override
    def _setting(self) -> str:
        return f"strategy='zero{self.stage}{'_offload' if self.offload else ''}'"

    @override
    def _parallel_degrees(self, world_size: int) -> ParallelDims:
        if world_size < 2:
            raise ValueError(
                f"{self._setting()} shards over data-parallel processes but the world size is {world_size}: "
                "set devices (or num_nodes) so there are at least 2 processes, "
                "or use strategy='auto' for one."
            )
        return ParallelDims.from_degrees(world_size, pp=1, dp=world_size, tp=1)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in ZERO_STAGES:
            description = f"ZeRO stage {stage} over the data-parallel ranks"
            strategy_registry.register(f"zero{stage}", cls, description=description, override=True, stage=stage)
        for stage in OFFLOAD_STAGES:
            description = f"ZeRO stage {stage} with the sharded states on the host"
            strategy_registry.register(
                f"zero{stage}_offload", cls, description=description, override=True, stage=stage, offload=True
            )
