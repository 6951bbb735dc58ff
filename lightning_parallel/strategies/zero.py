"""ZeRO stages 1, 2 and 3 (with offload) as a Lightning strategy over the data-parallel ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.mesh import DP, ParallelDims
from lightning_parallel.parallel.clip import GradPart
from lightning_parallel.parallel.fsdp import apply_fsdp
from lightning_parallel.parallel.state_dict import full_optimizer_state_dict, load_full_optimizer_state_dict
from lightning_parallel.parallel.zero import FlatZero, check_shardable_optimizer
from lightning_parallel.strategies.base import MeshStrategy

ZERO_STAGES = (1, 2, 3)
OFFLOAD_STAGES = (2, 3)


def check_zero_settings(stage: object, offload: object, *, stage_name: str = "stage") -> None:
    """Validate a ZeRO stage and offload flag before anything starts."""
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"{stage_name}={stage!r} is not a ZeRO stage: set {stage_name} to 1, 2 or 3.")
    if not isinstance(offload, bool):
        raise TypeError(f"offload={offload!r} must be True or False.")
    if offload and stage not in OFFLOAD_STAGES:
        raise ValueError(
            f"offload=True needs sharded gradients, which {stage_name}={stage} does not have (ZeRO-Offload "
            f"builds on stage 2): set {stage_name}=2 or {stage_name}=3, or offload=False."
        )


class ZeroStrategy(MeshStrategy):
    """ZeRO data parallelism: every rank trains on its own batch, model states are sharded.

    Stage 1 shards optimizer states, stage 2 also gradients, stage 3 also parameters (with torch's
    FSDP2). The user's ``configure_optimizers`` stays ordinary (AdamW, SGD, ...); the strategy shards it.
    Checkpoints hold full states in the single-process format, so they resume at any world size.

    Args:
        stage: 1, 2 or 3.
        offload: keep the sharded states on the host and step the optimizer there (stages 2 and 3).
        reshard_after_forward: stage 3 only: free gathered parameters after each unit's forward (less
            memory) or keep them until backward (less communication).
        **kwargs: passed to :class:`~lightning_parallel.strategies.base.MeshStrategy`
            (``accelerator``, ``parallel_devices``, ``cluster_environment``, ``process_group_backend``,
            ``timeout``, ...).
    """

    strategy_name = "zero"

    def __init__(
        self, stage: int = 2, offload: bool = False, reshard_after_forward: bool = True, **kwargs: Any
    ):
        check_zero_settings(stage, offload)
        super().__init__(**kwargs)
        self.stage = stage
        self.offload = offload
        self.reshard_after_forward = reshard_after_forward
        self._flat: dict[int, FlatZero] = {}  # id(optimizer) -> its stage-1/2 sharding
        self.fsdp_units: list[str] = []

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

    @override
    def _parallelize_model(self) -> None:
        if self.stage != 3:
            return
        assert self.model is not None
        self.fsdp_units = apply_fsdp(
            self.model,
            self.device_mesh[DP],
            reshard_after_forward=self.reshard_after_forward,
            offload=self.offload,
        )
        self._route_steps_through_root = "" in self.fsdp_units

    @override
    def _shard_optimizers(self) -> None:
        self._flat = {}
        for optimizer in self.optimizers:
            check_shardable_optimizer(optimizer, self._setting())
            if self.stage in (1, 2):
                group = self.device_mesh[DP].get_group()
                self._flat[id(optimizer)] = FlatZero(optimizer, group, self.stage, offload=self.offload)

    def _flat_zero(self, optimizer: Optimizer) -> FlatZero | None:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self._flat.get(id(optimizer))

    @override
    def _after_backward(self, optimizer: Optimizer) -> None:
        flat = self._flat_zero(optimizer)
        if flat is not None:
            flat.reduce_gradients()  # before clipping, so the norm is the averaged gradient's

    @override
    def _grad_parts(self, optimizer: Optimizer) -> list[GradPart]:
        flat = self._flat_zero(optimizer)
        if flat is None:
            return super()._grad_parts(optimizer)
        flat.reduce_gradients()
        return [(fg.shard.grad, (DP,)) for fg in flat.flat_groups if fg.shard.grad is not None]

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        flat = self._flat_zero(optimizer)
        if flat is not None:
            return flat.full_state_dict()
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return full_optimizer_state_dict(self.model, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.model is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            flat = self._flat_zero(optimizer)
            if flat is not None:
                flat.load_full_state_dict(state)
            else:
                load_full_optimizer_state_dict(self.model, optimizer, state)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in ZERO_STAGES:
            strategy_registry.register(
                f"zero{stage}",
                cls,
                description=f"ZeRO stage {stage} over the data-parallel ranks",
                override=True,
                stage=stage,
            )
        strategy_registry.register(
            "zero3_offload",
            cls,
            description="ZeRO stage 3 with states on the host",
            override=True,
            stage=3,
            offload=True,
        )
        strategy_registry.register(
            "zero2_offload",
            cls,
            description="ZeRO stage 2 with states on the host",
            override=True,
            stage=2,
            offload=True,
        )
