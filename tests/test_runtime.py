"""MeshRuntime, the object both front doors hold: built once from the settings, the step's reduction once between
two backwards, the loss replaced in one place (no process group)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from lightning_parallel import Hybrid3DFabricStrategy, Hybrid3DStrategy, ZeroFabricStrategy, ZeroStrategy
from lightning_parallel.parallel.parallelize import Parallelized
from lightning_parallel.parallel.pipeline.split import PipelineSplit
from lightning_parallel.strategies.runtime import MeshRuntime, keep_logits_split


def test_both_doors_hold_one_runtime_built_alike():
    for door in (Hybrid3DStrategy, Hybrid3DFabricStrategy):
        strategy = door(tp=2, timeout=12)
        assert type(strategy.runtime) is MeshRuntime and strategy.config is strategy.runtime.config
        assert (strategy.config.tp, strategy.runtime.timeout) == (2, timedelta(seconds=12))
    for door in (ZeroStrategy, ZeroFabricStrategy):
        runtime = door(stage=2).runtime
        assert runtime.setting() == "strategy='zero2'"
        with pytest.raises(ValueError, match="strategy='zero2' shards over data-parallel processes but the world size"):
            runtime.degrees(1)
        assert runtime.degrees(4).dp == 4 and runtime.dims.world_size == 4
    with pytest.raises(TypeError, match="Hybrid3DFabricStrategy got unknown setting"):
        Hybrid3DFabricStrategy(no_such_setting=1)


class CountingSharding:
    def __init__(self) -> None:
        self.reductions = 0

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self.reductions += 1


def test_the_step_reduces_once_between_backwards():
    runtime = Hybrid3DStrategy().runtime
    sharding = CountingSharding()
    runtime.sharding = sharding  # type: ignore[assignment]
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    runtime.new_backward()
    runtime.reduce_gradients(optimizer)  # Fabric: at clip_gradients ...
    runtime.reduce_gradients(optimizer)  # ... and again at optimizer.step(): one reduction
    assert sharding.reductions == 1
    runtime.new_backward()
    runtime.reduce_gradients(optimizer)
    assert sharding.reductions == 2


class WithLoss(nn.Module):
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).pow(2).mean()


def test_the_loss_is_replaced_under_tp_without_pp_only():
    for tp, split, replaced in ((1, None, False), (2, None, True), (2, PipelineSplit({}, 2, [0, 1], []), False)):
        module = WithLoss()
        original = module.loss
        keep_logits_split(module, Parallelized(split=split), tp)
        assert (module.loss != original) == replaced, (tp, split)


def test_the_doors_are_adapters_over_the_runtime_not_mixins():
    """Each front door derives from Lightning's strategy alone (its presets add a name and settings): what both do is
    the runtime's and the shared functions' (strategies/distributed.py, model_setup.py), no state through mixins."""
    from lightning.fabric.strategies.parallel import ParallelStrategy as FabricParallel
    from lightning.pytorch.strategies.parallel import ParallelStrategy as TrainerParallel

    from lightning_parallel.fabric.strategy import MeshFabricStrategy
    from lightning_parallel.strategies.base import MeshStrategy

    assert MeshStrategy.__bases__ == (TrainerParallel,)
    assert MeshFabricStrategy.__bases__ == (FabricParallel,)
    for door in (Hybrid3DStrategy, ZeroStrategy, Hybrid3DFabricStrategy, ZeroFabricStrategy):
        ours = [c for c in door.__mro__ if c.__module__.startswith("lightning_parallel")]
        assert all(c.__module__.endswith((".base", ".strategy", ".hybrid3d", ".zero", ".presets")) for c in ours), ours
