"""SyncBatchNorm over the dp axis: the layer alone against torch's BatchNorm on the concatenated batch (two gloo
processes), and training under Lightning's ddp and hybrid3d (dp, dp x tp) against one process on the whole batch.
Without the sync the same runs differ: the checks can fail."""

from __future__ import annotations

import json
from typing import NamedTuple

import lightning.pytorch as pl
import pytest
import torch
from conftest import Run, launch
from harness import run_worker
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from parity import assert_same_losses, assert_same_params
from torch import nn

from lightning_parallel import DataParallelSyncBatchNorm, Hybrid3DStrategy, ParallelDims
from lightning_parallel.models.vgg import VGG, VGGConfig
from lightning_parallel.parallel.data.sync_batchnorm import (
    SyncBatchNorm1d,
    SyncBatchNorm2d,
    SyncBatchNorm3d,
    SyncBatchNormXd,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from lightning_parallel.parallel.tensor.conv import ChannelNormParallel
from lightning_parallel.strategies.model_setup import sync_batchnorm_over_batch

UNIT_TOL = 1e-6  # |got - want| / (1 + |want|): float32 summation order only
MUST_DIFFER = 1e-4  # without the sync a run has to be at least this far from one process

# ----- one process: conversion, fallback, the plugin -----


def _norms() -> nn.Sequential:
    frozen = nn.BatchNorm2d(4)
    frozen.weight.requires_grad_(False)
    frozen.eval()
    return nn.Sequential(
        nn.BatchNorm1d(3),
        frozen,
        nn.Sequential(nn.BatchNorm3d(2, momentum=None, affine=False)),
        nn.SyncBatchNorm(5),
        nn.BatchNorm2d(6, track_running_stats=False).to(torch.float64),
    )


def test_convert_keeps_tensors_and_maps_each_kind():
    model = _norms()
    before = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    group = object()  # any handle: nothing is communicated here
    assert convert_sync_batchnorm(model, group) is model
    kinds = [SyncBatchNorm1d, SyncBatchNorm2d, SyncBatchNorm3d, SyncBatchNormXd, SyncBatchNorm2d]
    norms = [model[0], model[1], model[2][0], model[3], model[4]]
    assert [type(m) for m in norms] == kinds
    assert all(m.process_group is group for m in norms)
    # still torch's classes: ChannelNormParallel and anything else that checks for a BatchNorm accepts them
    assert isinstance(model[1], nn.BatchNorm2d) and isinstance(model[3], nn.SyncBatchNorm)
    assert all(isinstance(m, ChannelNormParallel.module_types) for m in norms)
    after = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == grads
    assert not model[1].training and model[0].training
    assert model[2][0].momentum is None and not model[2][0].affine and model[4].running_mean is None
    assert model[4].weight.dtype == torch.float64
    assert convert_sync_batchnorm(model, None) is model and model[0].process_group is None  # re-targeted
    root = nn.BatchNorm2d(4)
    assert type(convert_sync_batchnorm(root)) is SyncBatchNorm2d
    assert revert_sync_batchnorm(model) is model
    assert [type(m) for m in (model[0], model[1], model[2][0], model[3])] == [
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.SyncBatchNorm,
    ]
    assert all(t is before[k] for k, t in [*model.named_parameters(), *model.named_buffers()])


def test_lazy_batchnorm_is_refused():
    with pytest.raises(ValueError, match="LazyBatchNorm2d does not know its num_features.*run one batch"):
        convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_a_process_group_it_is_torch_batchnorm(momentum):
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3, momentum=momentum)
    synced = convert_sync_batchnorm(nn.BatchNorm2d(3, momentum=momentum))
    for _ in range(3):
        x = torch.randn(4, 3, 5, 5)
        assert torch.equal(synced(x), plain(x))
    assert all(torch.equal(a, b) for a, b in zip(synced.buffers(), plain.buffers()))
    synced.eval(), plain.eval()
    assert torch.equal(synced(x), plain(x))


def test_meta_built_layers_reset_after_conversion():
    """hybrid3d under pp converts a model built on the meta device; each stage's reset_parameters runs later."""
    torch.manual_seed(7)
    eager = VGG(VGGConfig(width=8))
    with torch.device("meta"):
        lazy = VGG(VGGConfig(width=8))
    convert_sync_batchnorm(lazy)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    assert type(lazy.features[0].bn) is SyncBatchNorm2d
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), name


def test_plugin_reaches_the_strategy_and_lightning_refuses_both_flags():
    plugin = DataParallelSyncBatchNorm()
    ddp = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], logger=False)
    assert ddp.strategy._layer_sync is plugin  # Lightning's ddp applies it in setup and reverts it after fit
    mesh = pl.Trainer(accelerator="cpu", devices=2, strategy=Hybrid3DStrategy(), sync_batchnorm=True, logger=False)
    assert type(mesh.strategy._layer_sync) is TorchSyncBatchNorm  # MeshStrategy.setup swaps in ours over dp
    with pytest.raises(MisconfigurationException, match="sync_batchnorm=True.*DataParallelSyncBatchNorm"):
        pl.Trainer(accelerator="cpu", devices=2, sync_batchnorm=True, plugins=[plugin], logger=False)


class _NoMesh:
    def group(self, role: str) -> None:
        return None


def test_hybrid3d_warns_that_microbatches_split_the_statistics(monkeypatch):
    strategy = Hybrid3DStrategy(pp=2)  # 1f1b with 2 * pp = 4 microbatches
    strategy.runtime.dims = ParallelDims.from_degrees(4, pp=2)
    strategy._layer_sync = TorchSyncBatchNorm()
    strategy.runtime.mesh = _NoMesh()  # no process group here: the conversion itself is left out
    strategy.model = torch.nn.BatchNorm1d(4)
    monkeypatch.setattr("lightning_parallel.strategies.model_setup.convert_sync_batchnorm", lambda model, group: model)
    batch = strategy.mesh.group("batch")
    with pytest.warns(UserWarning, match=r"pp=2 and microbatches=4: BatchNorm statistics cover one microbatch"):
        # what the Trainer door's setup runs before the split
        sync_batchnorm_over_batch(strategy.model, strategy._layer_sync, strategy.config, batch, rank_zero_warn)


# ----- (a) the layer alone, two processes, ranks with different batch sizes -----

UNIT_CASES = [
    {"name": "2d", "dims": 2},
    {"name": "1d_cumulative", "dims": 1, "momentum": None, "steps": 3, "sizes": [4, 2]},
    {"name": "3d_no_affine", "dims": 3, "affine": False},
    {"name": "from_torch_sync", "dims": 2, "from_sync": True},
    {"name": "one_rank_empty", "dims": 2, "sizes": [0, 6]},
    {"name": "dtensor", "dims": 2, "dtensor": True},
    {"name": "batch_split", "batch_split_input": True},
]


@pytest.fixture(scope="module")
def unit(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_bn_unit")
    return run_worker("sync_bn", 2, ["--cases", json.dumps(UNIT_CASES)], out, timeout=120)


@pytest.mark.parametrize("case", [c["name"] for c in UNIT_CASES if "batch_split_input" not in c])
def test_layer_equals_batchnorm_on_the_whole_batch(case, unit):
    for rank, results in enumerate(unit):
        got = next(r for r in results if r["name"] == case)
        for i, step in enumerate(got["train"]):
            errors = {k: v for k, v in step.items() if not k.endswith("_scale")}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= UNIT_TOL, f"{case} rank {rank} step {i}: {worst} off by {errors[worst]:.1e}"
            print(f"{case} rank {rank} step {i}: worst {worst} {errors[worst]:.1e}")
        assert got["eval_out"] <= UNIT_TOL, f"{case} rank {rank}: eval output off by {got['eval_out']:.1e}"
        assert got["dtensor_params"] == (case == "dtensor")


def test_input_split_on_the_batch_is_refused(unit):
    error = next(r for r in unit[0] if r["name"] == "batch_split")["error"]
    assert "SyncBatchNorm2d got an input DTensor placed (Shard(dim=0),)" in error and "Shard(1)" in error


# ----- (b) training: data parallelism with the sync is one process on the whole batch -----

VGG_RUN = {"model": "vgg", "steps": 4}  # the tiny VGG11 (width 8), SGD with momentum, 16 images per step


class Layout(NamedTuple):
    strategy: str
    world: int
    sync: str  # "plugin": Trainer(plugins=[DataParallelSyncBatchNorm()]); "trainer": Trainer(sync_batchnorm=True)
    dp_leaders: list[int]  # one rank per dp index: their losses average to the global batch's


LAYOUTS = {
    # Lightning's own ddp: the plugin (sync_batchnorm=True there means torch's, which refuses CPU modules)
    "ddp": Layout("ddp", 2, "plugin", [0, 1]),
    "hybrid3d-dp2-zero1": Layout("hybrid3d:dp=2,zero_stage=1", 2, "trainer", [0, 1]),
    # channel-split tp: each tp rank normalizes its channels with statistics over its dp peers
    "hybrid3d-dp2-tp2": Layout("hybrid3d:dp=2,tp=2", 4, "trainer", [0, 2]),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Run:
    return launch(tmp_path_factory, "auto", 1, [{**VGG_RUN, "name": "ref"}], tag="vgg_ref")


def check_parity(layout: Layout, one_process: Run, tmp_path_factory, tag: str, **extra) -> None:
    cases = [{**VGG_RUN, **extra, "name": "sync", "sync_bn": layout.sync}, {**VGG_RUN, **extra, "name": "plain"}]
    run = launch(tmp_path_factory, layout.strategy, layout.world, cases, tag=tag)
    want_losses, want = one_process.losses("ref"), one_process.params("ref")
    assert any("running_var" in k for k in want), "running statistics must be compared too"
    loss_rel = assert_same_losses(run.losses("sync", layout.dp_leaders), want_losses, f"{tag} sync")
    param_abs = assert_same_params(run.params("sync"), want, f"{tag} sync (running statistics included)")
    print(f"{tag} with sync: max loss rel diff {loss_rel:.1e}, max param/buffer abs diff {param_abs:.1e}")
    # the same run without the sync normalizes each rank's half-batch on its own: not the same training
    plain_losses, plain = run.losses("plain", layout.dp_leaders), run.params("plain")
    loss_gap = max(abs(g - w) / w for g, w in zip(plain_losses, want_losses))
    weight_gap = max((plain[k] - want[k]).abs().max().item() for k in want if k.endswith("weight"))
    stats_gap = max((plain[k] - want[k]).abs().max().item() for k in want if "running" in k)
    print(f"{tag} without sync: loss rel diff {loss_gap:.1e}, weights {weight_gap:.1e}, running stats {stats_gap:.1e}")
    assert min(loss_gap, weight_gap, stats_gap) > MUST_DIFFER, f"{tag}: without the sync the run should differ"


@pytest.mark.parametrize(
    "name", [pytest.param(k, marks=pytest.mark.slow) if v.world > 2 else k for k, v in LAYOUTS.items()]
)
def test_training_with_sync_equals_one_process(name, one_process, tmp_path_factory):
    check_parity(LAYOUTS[name], one_process, tmp_path_factory, name)


@pytest.mark.slow
def test_pipeline_stages_built_on_meta(one_process, tmp_path_factory):
    """pp=2 x dp=2, VGG built in configure_model on the meta device: converted before the stages are
    materialized and reset. One microbatch, so each dp rank's batch is one BatchNorm batch."""
    layout = Layout("hybrid3d:dp=2,pp=2,pp_schedule=gpipe,microbatches=1", 4, "trainer", [0, 1])
    check_parity(layout, one_process, tmp_path_factory, "hybrid3d-pp2-dp2-meta", meta=True)
