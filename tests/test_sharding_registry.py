"""Shardings by name: the registry the ZeRO stages and ``ParallelConfig.sharding`` pick from, HSDP read from the mesh
by every sharding, and a new variant added the way ARCHITECTURE.md says (a dry run: the tiny
:class:`CountedShardGradients` below, registered here, selected by config and trained at world 2 against one
process)."""

from __future__ import annotations

import pytest
from conftest import PARITY_CASES, Batch
from omegaconf.errors import ConfigKeyError
from parity import assert_same_losses, assert_same_params
from torch.optim import Optimizer

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.flat_sharding import ShardGradients
from lightning_parallel.parallel.data.fsdp import ShardParameters
from lightning_parallel.parallel.data.sharding import SHARDINGS, register_sharding
from lightning_parallel.parallel.data.stages import ZERO_NAMES, ZERO_STAGES, sharding_class
from lightning_parallel.recipes.common import build_strategy
from lightning_parallel.recipes.strategy_conf import strategy_conf
from lightning_parallel.strategies.zero import ZERO_PRESETS

VARIANT = "zero2_counted"
CASES = [c for c in PARITY_CASES if c["name"] in ("plain", "accumulate")]


@register_sharding(VARIANT)
class CountedShardGradients(ShardGradients):
    """ZeRO-2 that counts its gradient reductions: the smallest variant that shows it is the one that ran."""

    summary = ShardGradients.summary + ", reductions counted"
    reductions = 0

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        type(self).reductions += 1
        super().reduce_gradients(optimizer)


@register_sharding("zero3_no_hsdp")
class UnreplicatedShardParameters(ShardParameters):
    supports_hsdp = False


def test_zero_stages_are_names_in_the_registry():
    assert ZERO_NAMES == {0: "replicate", 1: "zero1", 2: "zero2", 3: "zero3"}
    assert {stage: cls.name for stage, cls in ZERO_STAGES.items()} == ZERO_NAMES
    assert all(SHARDINGS[name].stage == stage for stage, name in ZERO_NAMES.items())
    for stage in range(4):
        assert sharding_class(ParallelConfig(zero_stage=stage).validate()) is ZERO_STAGES[stage]


def test_a_registered_variant_is_selected_by_config():
    config = ParallelConfig(sharding=VARIANT).validate()
    assert config.zero_stage == 2 and sharding_class(config) is CountedShardGradients
    assert "sharding='zero2_counted'" in config.describe()
    assert ParallelConfig(sharding=VARIANT, zero_stage=2).validate().zero_stage == 2
    assert ParallelConfig(sharding=VARIANT, offload=True).validate().offload  # ZeRO-2's offload, inherited
    with pytest.raises(ValueError, match="'zero2' names ShardGradients already: register CountedShardGradients"):
        register_sharding("zero2")(CountedShardGradients)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sharding": "zero9"}, r"sharding=.zero9. is not a registered sharding: set sharding to one of .*counted"),
        ({"sharding": VARIANT, "zero_stage": 3}, r"sharding='zero2_counted' is ZeRO stage 2, and zero_stage=3"),
        ({"sharding": "replicate", "offload": True}, r"offload=True needs sharded gradients"),
        ({"sharding": "zero3_no_hsdp", "dp": 4, "dp_shard": 2}, r"\(HSDP\) with sharding='zero3_no_hsdp' is not"),
        ({"zero_stage": 0, "dp": 4, "dp_shard": 2}, r"dp_shard=2 \(HSDP\) with zero_stage=0 is not supported"),
    ],
)
def test_sharding_settings_are_refused_before_launch(settings, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**settings).validate()


def test_the_mesh_is_arithmetic_and_the_config_checks():
    """ep and dp_shard against the resolved dp="auto": ParallelConfig.dims says, in the mesh's old words."""
    with pytest.raises(ValueError, match=r"ep=4 must divide the data-parallel degree dp=2 .* or change pp, tp"):
        ParallelConfig(ep=4, tp=2).validate().dims(4)
    with pytest.raises(ValueError, match=r"dp_shard=3 must divide dp=4 .* divisors of 4"):
        ParallelConfig(dp_shard=3, zero_stage=3).validate().dims(4)
    dims = ParallelConfig(dp_shard=2, zero_stage=2).validate().dims(8)
    assert (dims.dp, dims.dpr, dims.dp_shard) == (8, 4, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    """The variant at world 2 through a worker that registers it (a variant in the package needs none: importing
    parallel/data/stages.py registers it)."""
    runs = {VARIANT: (2, f"hybrid3d:sharding={VARIANT}", CASES)}
    return Batch(tmp_path_factory, runs, tag="registry", worker="sharding_registry")


def test_a_registered_variant_trains_like_one_process(reference, runs):
    run = runs[VARIANT]
    for case in CASES:
        label = f"{VARIANT} world 2 {case['name']}"
        assert_same_losses(run.losses(case["name"]), reference.losses(case["name"]), label)
        assert_same_params(run.params(case["name"]), reference.params(case["name"]), label)
        for rank in range(2):  # one reduction per optimizer step, through the variant's class
            assert run.case(case["name"], rank)["variant_reductions"] == case["steps"], label


def test_the_recipes_read_the_strategies_presets_and_pass_a_sharding_on():
    built = build_strategy(strategy_conf("zero2", sharding=VARIANT))
    assert (built.config.sharding, built.config.zero_stage) == (VARIANT, 2)
    assert ZERO_PRESETS == {
        "zero1": (1, False),
        "zero2": (2, False),
        "zero3": (3, False),
        "zero2_offload": (2, True),
        "zero3_offload": (3, True),
    }
    with pytest.raises(ConfigKeyError, match=r"Key 'sharding' not in 'the keys of strategy=ddp"):
        strategy_conf("ddp", sharding=VARIANT)  # ddp does not shard: its schema has no sharding section
