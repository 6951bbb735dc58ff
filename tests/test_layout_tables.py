"""The tables every part of the package shares, without any process group: the parallel settings
(ParallelConfig), the pipeline schedules and the data-parallel shardings."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.stages import OFFLOAD_STAGES, ZERO_STAGES, check_zero_settings
from lightning_parallel.parallel.pipeline.schedules import SCHEDULES, schedule_spec
from lightning_parallel.parallel.sections import recipe_key
from lightning_parallel.recipes.auto import AUTO_KEYS
from lightning_parallel.recipes.common import ASYNC_PS_KEYS
from lightning_parallel.recipes.strategy_conf import AsyncPSConf, AutoConf, Hybrid3DConf, strategy_conf


def test_every_schedule_row_names_a_torch_class_that_fits_its_stage_count():
    for name, spec in SCHEDULES.items():
        cls = spec.schedule_class
        multi = issubclass(cls, PipelineScheduleMulti)
        assert multi == spec.multi_stage, name
        assert issubclass(cls, PipelineScheduleMulti if spec.stages_per_rank() > 1 else PipelineScheduleSingle), name
        assert spec.stage_ranks(2 * spec.stages_per_rank(), 2) == (
            [0, 1, 1, 0] if spec.placement == "v" else [0, 1] * spec.stages_per_rank()
        ), name


def test_schedule_microbatch_rules():
    schedule_spec("gpipe").check_microbatches(1, 4, "x")  # GPipe takes any count
    with pytest.raises(ValueError, match=r"microbatches=2 < pp=4"):
        schedule_spec("1f1b").check_microbatches(2, 4, "x")
    schedule_spec("1f1b").check_microbatches(5, 4, "x")
    with pytest.raises(ValueError, match=r"microbatches=5 must be a multiple of 2"):
        schedule_spec("interleaved_1f1b").check_microbatches(5, 2, "x")
    with pytest.raises(ValueError, match=r"pp_schedule='fast' is unknown: set it to one of gpipe, 1f1b"):
        schedule_spec("fast")


def test_sharding_rows_shard_more_as_the_stage_grows():
    assert list(ZERO_STAGES) == [0, 1, 2, 3]
    sharded = [ZERO_STAGES[s].sharded for s in range(4)]
    assert all(a < b for a, b in zip(sharded, sharded[1:]))  # each stage adds one kind of state
    assert OFFLOAD_STAGES == (2, 3)
    with pytest.raises(ValueError, match=r"zero_stage=4 is not a ZeRO stage: set zero_stage to 0, 1, 2 or 3"):
        check_zero_settings(4, False, name="zero_stage", allow_zero=True)
    with pytest.raises(ValueError, match=r"offload=True needs sharded gradients.*set stage=2 or stage=3"):
        check_zero_settings(1, True)


def test_config_validates_and_fills_what_it_derives():
    config = ParallelConfig(pp=2, tp=2).validate()
    assert config.microbatches == 4  # 2 * pp
    assert config.stages_per_rank == 1
    assert ParallelConfig(pp=2, pp_schedule="zero_bubble").validate().stages_per_rank == 2
    with pytest.warns(UserWarning, match=r"keeps parameters gathered"):
        assert not ParallelConfig(pp=2, pp_schedule="zero_bubble", zero_stage=3).validate().reshard_after_forward
    assert ParallelConfig(pp=4, dp=2).dims(8).tp == 1
    with pytest.raises(ValueError, match=r"pp=0 is not a parallel degree"):
        ParallelConfig(pp=0).validate()


def test_config_is_declared_once_for_strategies_recipes_and_planner():
    """The recipes' hybrid3d schema holds every parallel setting (top-level or in its section) with ParallelConfig's
    default; auto adds its own keys, async_ps has only its own (its strategy has no mesh)."""
    conf = strategy_conf("hybrid3d")
    assert ParallelConfig.from_mapping(conf) == ParallelConfig()
    for f in dataclasses.fields(ParallelConfig):
        assert OmegaConf.select(conf, recipe_key(f.name), default="absent") == f.default, f.name
    auto = {f.name for f in dataclasses.fields(AutoConf)} - {"name"}
    assert auto - {f.name for f in dataclasses.fields(Hybrid3DConf)} == set(AUTO_KEYS)
    assert {f.name for f in dataclasses.fields(AsyncPSConf)} == {"name", "timeout_s", *ASYNC_PS_KEYS}
