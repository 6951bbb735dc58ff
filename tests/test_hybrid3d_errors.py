"""Bad hybrid3d settings fail at once with the setting and the fix, before any process group exists."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

import lightning_parallel  # noqa: F401
from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.models import GPTConfig, LitGPT


@pytest.fixture(autouse=True)
def no_process_group_left():
    yield
    assert not dist.is_initialized(), "a bad setting must fail before the process group is created"


def trainer(devices: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(strategy=Hybrid3DStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)


def test_degrees_must_multiply_to_the_world_size():
    with pytest.raises(ValueError, match=r"pp\(1\) \* dp\(3\) \* tp\(2\) = 6 != world_size\(4\)"):
        trainer(4, dp=3, tp=2)


def test_auto_dp_needs_a_divisible_world():
    with pytest.raises(ValueError, match=r"dp='auto' needs world_size\(4\) divisible by pp\(1\) \* tp\(3\)"):
        trainer(4, tp=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, r"tp=0 is not a parallel degree"),
        ({"dp": "all"}, r"dp='all' is not a parallel degree: set dp to a positive integer or 'auto'"),
        ({"zero_stage": 4}, r"zero_stage=4 is not a ZeRO stage: set zero_stage to 0, 1, 2 or 3"),
        ({"zero_stage": 1, "offload": True}, r"offload=True needs sharded gradients"),
        ({"pp_schedule": "fast"}, r"pp_schedule='fast' is unknown: set it to one of gpipe, 1f1b"),
        ({"pp_balance": "magic"}, r"pp_balance='magic' is unknown"),
        ({"microbatches": 0}, r"microbatches=0 is not a parallel degree"),
        ({"pp": 2}, r"pp=2: pipeline parallelism is not available in this version yet"),
        ({"activation_checkpointing": "full"}, r"activation_checkpointing='full' is not available yet"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Hybrid3DStrategy(**kwargs)


def test_tp_must_divide_the_heads():
    model = LitGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=6, d_model=48))
    with pytest.raises(ValueError, match=r"tp=4 does not divide .*=(6|48)"):
        trainer(4, tp=4).fit(model)


def test_tp_must_divide_the_vocabulary():
    model = LitGPT(GPTConfig(vocab_size=66, seq_len=16, n_layer=2, n_head=4, d_model=32))
    with pytest.raises(ValueError, match=r"tp=4 does not divide model.wte.num_embeddings \(the vocabulary\)=66"):
        trainer(4, tp=4).fit(model)


class NoProtocol(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)


def test_tensor_parallel_needs_the_protocol():
    with pytest.raises(TypeError, match=r"tp=2 needs NoProtocol.tensor_parallel_plan\(sequence_parallel\)"):
        trainer(2, tp=2).fit(NoProtocol())


def test_registered_name():
    t = pl.Trainer(strategy="hybrid3d", accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy, Hybrid3DStrategy)
    assert (t.strategy.parallel_dims.dp, t.strategy.parallel_dims.tp) == (2, 1)


def test_pipeline_settings_at_pp1_warn_that_they_are_ignored():
    with pytest.warns(UserWarning, match=r"only apply with pp > 1: ignored at pp=1"):
        Hybrid3DStrategy(pp_schedule="gpipe")
