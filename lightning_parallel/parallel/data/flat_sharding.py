"""ZeRO stages 1 and 2 as data-parallel shardings: each optimizer's groups packed into flat buffers
(:class:`~lightning_parallel.parallel.data.flat_zero.FlatZero`), each rank stepping its slice; registered as
``zero1`` and ``zero2``. Pure torch, no Lightning.
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from lightning_parallel.parallel.data.flat_overlap import flat_overlap_stats
from lightning_parallel.parallel.data.flat_zero import FlatZero
from lightning_parallel.parallel.data.fsdp import fsdp_units
from lightning_parallel.parallel.data.overlap import Prepare
from lightning_parallel.parallel.data.sharding import (
    DataParallelSharding,
    FlatSlice,
    GradPiece,
    StateView,
    register_sharding,
)
from lightning_parallel.parallel.dtensor import split_axes


class FlatSharding(DataParallelSharding):
    """Stages 1 and 2: each optimizer's groups packed into flat buffers, each rank stepping its slice."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._flat: dict[int, FlatZero] = {}  # id(optimizer) -> its flat sharding
        self._layers: list[tuple[nn.Module, list[str]]] = []  # roots and their layers (overlap: forward pre-hooks)

    def shard_module(self, root: nn.Module, units: list[str] | None = None) -> list[str]:
        # nothing sharded: the layers (ZeRO-3's units) are remembered for overlap_grad_reduce's forward hooks
        if self.overlap_grad_reduce:
            self._layers.append((root, fsdp_units(root) if units is None else units))
        return []

    def shard_optimizer(self, optimizer: Optimizer) -> None:
        super().shard_optimizer(optimizer)
        self._flat[id(optimizer)] = FlatZero(
            optimizer,
            self.group,
            self.stage,
            offload=self.offload,
            expert_group=self.expert_group,
            wire_dtype=self.wire_dtype,
            overlap_bucket_mb=self.bucket_mb if self.overlap_grad_reduce else None,
            powersgd=self.powersgd,
            replicate_group=self.replicate_group,
        )

    def before_last_backward(
        self, optimizer: Optimizer, only: list[nn.Parameter] | None = None, prepare: Prepare | None = None
    ) -> None:
        flat = self._of(optimizer)
        if flat._overlap and not flat.forward_waits:  # the gathers after each step: waited for in forward
            for buckets in flat._overlap.values():
                for root, layers in self._layers:
                    buckets.wait_before_forward(root, layers)
            flat.forward_waits = True
        flat.arm(only, prepare)

    def arm_more(self, optimizer: Optimizer, params: list[nn.Parameter], ready: bool = False) -> None:
        self._of(optimizer).arm_more(params, ready)

    def settle_params(self) -> None:
        for flat in self._flat.values():
            flat.settle()

    def overlap_stats(self) -> dict[str, int]:
        return flat_overlap_stats([b for flat in self._flat.values() for b in flat._overlap.values()])

    def state_view(self, optimizer: Optimizer) -> StateView | None:
        flat = self._flat.get(id(optimizer))
        if flat is None:
            return None
        slices = [
            [FlatSlice(fg.params, fg.offsets, *fg.local_range(), fg.shard, fg.flat_param, fg.group) for fg in fgs]
            for fgs in flat.groups
        ]
        return StateView(flat.optimizer, flat.original_params, slices, flat.reload_offloaded)

    def _of(self, optimizer: Optimizer) -> FlatZero:
        flat = self._flat.get(id(optimizer))
        assert flat is not None, "shard_optimizer() takes every optimizer first"
        return flat

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        self._of(optimizer).reduce_gradients()

    def grad_pieces(self, optimizer: Optimizer) -> list[GradPiece]:
        return [
            (g, p, (*(self.expert_axes if fg.expert else self.axes), *split_axes(p)))
            for g, p, fg in self._of(optimizer).shard_grad_segments()
        ]

    def after_step(self, optimizer: Optimizer) -> None:
        self._of(optimizer).discard_unstepped()  # fp16 skipped the update: forget the reduced gradients

    def param_groups(self, optimizer: Optimizer) -> list[list[nn.Parameter]]:
        return self._of(optimizer).original_params


@register_sharding("zero1")
class ShardOptimizer(FlatSharding):
    stage = 1
    sharded = frozenset({"optimizer"})
    comm_factor = 1.5  # gradients all-reduced (whole on every rank for hooks and clipping), slices all-gathered
    summary = "optimizer states sharded"


@register_sharding("zero2")
class ShardGradients(FlatSharding):
    stage = 2
    sharded = frozenset({"optimizer", "grads"})
    comm_factor = 1.0  # reduce-scatter + all-gather: an all-reduce's volume
    supports_offload = True
    summary = "optimizer states and gradients sharded"
