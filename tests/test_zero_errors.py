"""Bad ZeRO settings fail at once, naming the setting and the fix, before any process group exists."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from conftest import Batch

import lightning_parallel  # noqa: F401
from lightning_parallel import ZeroStrategy
from lightning_parallel.parallel.data.sharding import check_shardable_optimizer


@pytest.fixture(autouse=True)
def no_process_group_left():
    yield
    assert not dist.is_initialized(), "a bad setting must fail before the process group is created"


@pytest.mark.parametrize("stage", [0, 4, "3", None, True])
def test_unknown_stage(stage):
    with pytest.raises(ValueError, match=rf"stage={stage!r} is not a ZeRO stage: set stage to 1, 2 or 3"):
        ZeroStrategy(stage=stage)


def test_offload_needs_a_stage_that_shards_gradients():
    with pytest.raises(ValueError, match=r"offload=True needs sharded gradients.*set stage=2 or stage=3"):
        ZeroStrategy(stage=1, offload=True)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_one_process_cannot_shard(name):
    with pytest.raises(ValueError, match=rf"strategy='{name}'.*world size is 1.*at least 2 processes"):
        pl.Trainer(strategy=name, accelerator="cpu", devices=1)


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision_names_the_choices(precision):
    choices = "32-true, bf16-mixed, 16-mixed, bf16-true"
    with pytest.raises(ValueError, match=rf"precision='{precision}' is not supported.*{choices}"):
        pl.Trainer(strategy="zero2", accelerator="cpu", devices=2, precision=precision)


def test_registered_names_build_the_right_strategy():
    for name, stage, offload in [
        ("zero1", 1, False),
        ("zero2", 2, False),
        ("zero3", 3, False),
        ("zero3_offload", 3, True),
    ]:
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, ZeroStrategy)
        assert (trainer.strategy.stage, trainer.strategy.offload) == (stage, offload)
        assert trainer.strategy.parallel_dims.dp == 2


def test_non_elementwise_optimizer_is_refused():
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(TypeError, match=r"zero2.*cannot shard LBFGS.*Return one of SGD, Adam, AdamW"):
        check_shardable_optimizer(torch.optim.LBFGS(params), "strategy='zero2'")
    check_shardable_optimizer(torch.optim.AdamW(params), "strategy='zero2'")


LBFGS = [{"name": "lbfgs", "optimizer": "lbfgs", "expect_error": True}]


@pytest.fixture(scope="module")
def lbfgs_runs(tmp_path_factory) -> Batch:
    return Batch(tmp_path_factory, {s: (2, s, LBFGS) for s in ("zero1", "zero3")}, tag="lbfgs")


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_non_elementwise_optimizer_is_refused_in_training(strategy, lbfgs_runs):
    run = lbfgs_runs[strategy]
    for rank in range(2):
        error = run.case("lbfgs", rank).get("error", "")
        assert error.startswith("TypeError"), f"rank {rank}: {error or 'trained without an error'}"
        assert f"strategy='{strategy}' cannot shard LBFGS" in error
