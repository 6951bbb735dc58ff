"""Bad hybrid3d settings fail at once with the setting and the fix, before any process group exists."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

import lightning_parallel  # noqa: F401
from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.models import GPTConfig, GPTModule


@pytest.fixture(autouse=True)
def no_process_group_left():
    yield
    assert not dist.is_initialized(), "a bad setting must fail before the process group is created"


def trainer(devices: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=Hybrid3DStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)


# bad arguments, degrees against the world size: tests/test_bad_input_catalogue.py


@pytest.fixture(autouse=True)
def no_worker_may_start(monkeypatch):
    """A model the layout cannot split must fail in this process: Lightning's launcher would start the
    other ranks by re-running the command (here: the whole pytest session) only to fail the same way."""

    def refuse(*args, **kwargs):
        raise AssertionError("Lightning's launcher started worker processes before the model was checked")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", refuse)


def test_tp_must_divide_the_heads():
    model = GPTModule(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=6, d_model=48))
    with pytest.raises(ValueError, match=r"tp=4 does not divide .*=(6|48)"):
        trainer(4, tp=4).fit(model)


def test_tp_must_divide_the_vocabulary():
    model = GPTModule(GPTConfig(vocab_size=66, seq_len=16, n_layer=2, n_head=4, d_model=32))
    with pytest.raises(ValueError, match=r"tp=4 does not divide GPTConfig.vocab_size=66: choose tp among its divisors"):
        trainer(4, tp=4).fit(model)


class NoProtocol(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)


def test_tensor_parallel_needs_the_protocol():
    with pytest.raises(TypeError, match=r"tp=2 needs NoProtocol.tensor_parallel_plan\(sequence_parallel\)"):
        trainer(2, tp=2).fit(NoProtocol())


def test_pipeline_needs_the_protocol():
    with pytest.raises(TypeError, match=r"pp=2 needs NoProtocol.pipeline_layers and .loss\(\)"):
        trainer(2, pp=2).fit(NoProtocol())


def test_more_stages_than_layers():
    model = GPTModule(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32))  # 4 pipeline layers
    with pytest.raises(ValueError, match=r"needs 8 pipeline stages but the model has only 4 pipeline layers"):
        trainer(4, pp=4, pp_schedule="interleaved_1f1b").fit(model)
    with pytest.raises(ValueError, match=r"needs 8 pipeline stages but the model has only 4 pipeline layers"):
        trainer(8, pp=8).fit(model)


def test_microbatches_must_divide_the_batch(tmp_path_factory):
    from conftest import launch

    case = {"name": "odd", "steps": 2, "expect_error": True}  # 16 samples per rank, 3 microbatches
    run = launch(tmp_path_factory, "hybrid3d:pp=2,microbatches=3", 2, [case])
    for rank in range(2):
        error = run.case("odd", rank)["error"]
        assert "A batch of 16 samples per data-parallel rank does not split into microbatches=3" in error, error


def test_registered_name():
    t = pl.Trainer(strategy="hybrid3d", accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy, Hybrid3DStrategy)
    assert (t.strategy.parallel_dims.dp, t.strategy.parallel_dims.tp) == (2, 1)


def test_pipeline_settings_at_pp1_warn_that_they_are_ignored():
    with pytest.warns(UserWarning, match=r"only apply with pp > 1: ignored at pp=1"):
        Hybrid3DStrategy(pp_schedule="gpipe")
