"""VGG and its channel-split tensor parallelism: shapes and layers (one process), parity of the tp=2 model with
a plain copy (two gloo processes), and the errors a user can configure into."""

from __future__ import annotations

import inspect
import json

import lightning.pytorch as pl
import pytest
import torch
from harness import run_worker
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import DataParallelSyncBatchNorm
from lightning_parallel.models.lit_vgg import LitVGG
from lightning_parallel.models.vgg import VGG, VGGConfig, vgg_tp_plan
from lightning_parallel.parallel.data.sync_batchnorm import SyncBatchNorm2d
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.parallel.tensor.conv import (
    ChannelInParallel,
    ChannelNormParallel,
    ChannelOutParallel,
    check_conv_tp_plan,
)

TOL = 1e-5
# 8 convs (VGG11) and 13 (VGG16, odd: its first conv stays replicated); without BatchNorm the convs have biases
TP_CASES = [
    {"name": "vgg11", "model": "vgg11"},
    {"name": "vgg16", "model": "vgg16"},
    {"name": "vgg11_no_bn", "model": "vgg11", "batch_norm": False},
]


def tiny(name: str, **kwargs) -> VGGConfig:
    return VGGConfig(name=name, width=8, **kwargs)  # channels 8, 16, 32, 64, 64: tp 1, 2, 4, 8 divide them


# ----- one process -----


@pytest.mark.parametrize(("name", "convs"), [("vgg11", 8), ("vgg16", 13)])
def test_forward_shapes_and_layers(name, convs):
    torch.manual_seed(0)
    model = VGG(tiny(name))
    x = torch.randn(3, 3, 32, 32)  # (B, C, H, W)
    layers = model.layers()
    assert len(layers) == convs + 1 and layers[-1] is model.head
    h = x
    for layer in layers[:-1]:
        h = layer(h)
    assert h.shape == (3, 64, 1, 1)  # five max-pools: 32 -> 1; 8 * width channels
    assert torch.equal(layers[-1](h), model(x))
    assert model(x).shape == (3, 10)


def test_layers_reset_to_the_same_weights_wherever_built():
    """A layer built on the meta device and reset gets the weights of one built eagerly (same seed)."""
    torch.manual_seed(7)
    eager = VGG(tiny("vgg11"))
    with torch.device("meta"):
        lazy = VGG(tiny("vgg11"))
    lazy.to_empty(device="cpu")
    for layer in reversed(lazy.layers()):  # order must not matter: each layer seeds from its own index
        layer.reset_parameters()
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), name


def test_plan_pairs_channels_like_megatron():
    plan = vgg_tp_plan("model.", tiny("vgg11"))
    for i in (0, 2, 4, 6):
        assert isinstance(plan[f"model.features.{i}.conv"], ChannelOutParallel)
        assert isinstance(plan[f"model.features.{i}.bn"], ChannelNormParallel)
        assert isinstance(plan[f"model.features.{i + 1}.conv"], ChannelInParallel)
        assert f"model.features.{i + 1}.bn" not in plan  # after the sum: replicated
    assert isinstance(plan["model.head.fc1"], ColwiseParallel) and isinstance(plan["model.head.fc2"], RowwiseParallel)
    odd = vgg_tp_plan("", tiny("vgg16"))
    assert "features.0.conv" not in odd and isinstance(odd["features.12.conv"], ChannelInParallel)
    assert not any(k.endswith(".bn") for k in vgg_tp_plan("", tiny("vgg11", batch_norm=False)))


def test_config_errors():
    with pytest.raises(ValueError, match=r"VGGConfig.name='vgg19' is not one of \['vgg11', 'vgg16'\]"):
        VGGConfig(name="vgg19")
    with pytest.raises(ValueError, match="image_size=48 must be a multiple of 32"):
        VGGConfig(image_size=48)


def test_channel_styles_refuse_other_modules():
    with pytest.raises(TypeError, match="ChannelOutParallel applies to Conv1d, Conv2d, Conv3d, not Linear"):
        ChannelOutParallel()._apply(nn.Linear(4, 4), None)
    with pytest.raises(TypeError, match="ChannelNormParallel applies to .*BatchNorm2d.*, not Conv2d"):
        ChannelNormParallel()._apply(nn.Conv2d(4, 4, 3), None)
    with pytest.raises(ValueError, match="needs groups=1"):
        ChannelInParallel()._apply(nn.Conv2d(4, 4, 3, groups=2), None)


# ----- (c) tp that does not divide a split channel count -----


def test_tp_not_dividing_channels_names_layer_count_and_fix():
    with pytest.raises(
        ValueError,
        match=r"tp=4 does not divide features\.0\.conv\.out_channels=6: ChannelOutParallel .* "
        r"Choose tp among \[1, 2, 3, 6\], or change VGGConfig\.width",
    ):
        VGG.check_tensor_parallel_config(VGGConfig(width=6), tp=4)
    # VGG16 leaves its first conv whole: the first split is conv 1's
    with pytest.raises(ValueError, match=r"features\.1\.conv\.out_channels=6"):
        VGG.check_tensor_parallel_config(VGGConfig(name="vgg16", width=6), tp=4)
    # through the LightningModule's protocol, with the strategy's path prefix
    with pytest.raises(ValueError, match=r"tp=16 does not divide features\.0\.conv\.out_channels=8"):
        LitVGG(tiny("vgg11")).check_parallel_degrees(ParallelDims.of(tp=16))
    LitVGG(tiny("vgg16")).check_parallel_degrees(ParallelDims.of(tp=8))  # 8 divides every split count


def test_check_names_in_channels_and_norm_features():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3))
    with pytest.raises(ValueError, match=r"tp=3 does not divide 0\.out_channels=4"):
        check_conv_tp_plan(model, {"0": ChannelOutParallel()}, tp=3)
    with pytest.raises(ValueError, match=r"tp=3 does not divide 1\.num_features=4"):
        check_conv_tp_plan(model, {"1": ChannelNormParallel()}, tp=3)
    with pytest.raises(ValueError, match=r"tp=3 does not divide 2\.in_channels=4"):
        check_conv_tp_plan(model, {"2": ChannelInParallel()}, tp=3)


# ----- the LightningModule -----


def test_lit_vgg_protocol_and_options():
    lit = LitVGG(tiny("vgg16"))
    assert lit.pipeline_layers() == lit.model.layers() and len(lit.pipeline_layers()) == 14
    assert set(lit.tensor_parallel_plan()) == set(vgg_tp_plan("model.", lit.config))
    with pytest.raises(ValueError, match="no sequence dimension to split: set sequence_parallel=False"):
        lit.tensor_parallel_plan(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"optimizer='lbfgs'"):
        LitVGG(optimizer="lbfgs")


def test_lit_vgg_batchnorm_sync_is_the_trainers():
    """No flag on the module: Trainer(sync_batchnorm=True) or the plugin swaps its BatchNorms (the strategy
    does it before splitting the model); the swapped ones keep their tensors and the tp plan still applies."""
    lit = LitVGG(tiny("vgg16"))
    assert "sync_batchnorm" not in inspect.signature(LitVGG).parameters
    weight = lit.model.features[0].bn.weight
    assert DataParallelSyncBatchNorm().apply(lit) is lit
    norms = [m for m in lit.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 13 and all(type(m) is SyncBatchNorm2d for m in norms)
    assert lit.model.features[0].bn.weight is weight
    lit.check_parallel_degrees(ParallelDims.of(tp=8))  # ChannelNormParallel still takes the swapped BatchNorms
    check_conv_tp_plan(lit, lit.tensor_parallel_plan(), tp=8)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_lit_vgg_trains_and_validates_under_auto(optimizer):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))
    lit = LitVGG(tiny("vgg11"), optimizer=optimizer, lr=1e-3)
    before = [p.detach().clone() for p in lit.parameters()]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    assert {"train_loss", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    assert 0.0 <= trainer.callback_metrics["val_acc"].item() <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, lit.parameters()))
    assert trainer.test(lit, DataLoader(data, batch_size=8), verbose=False)[0]["test_loss"] > 0


# ----- (b) two processes: the channel-split model is the plain one -----


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("vgg_tp2")
    return run_worker("vgg", 2, ["--cases", json.dumps(TP_CASES)], out, timeout=120)


@pytest.mark.parametrize("case", [c["name"] for c in TP_CASES])
def test_tp2_matches_single_process(case, tp2):
    for rank, results in enumerate(tp2):
        got = next(r for r in results if r["name"] == case)
        assert got["sharded_params"] > 0 and got["local_numel"] < got["full_numel"], f"{case}: nothing was split"
        for i, step in enumerate([*got["train"], got["eval"]]):
            mode = "eval" if i == len(got["train"]) else f"train step {i}"
            where = f"{case} rank {rank} {mode}"
            assert step["logits"] <= TOL, f"{where}: logits differ by {step['logits']:.2e}"
            assert step["input_grad"] <= TOL, f"{where}: input gradient differs by {step['input_grad']:.2e}"
            assert step["grad"] <= TOL, f"{where}: {step['worst_grad']}.grad differs by {step['grad']:.2e}"
            assert step["buffer"] <= TOL, f"{where}: BatchNorm running statistics differ by {step['buffer']:.2e}"
            print(
                f"{where}: logits {step['logits']:.1e}, input grad {step['input_grad']:.1e}, "
                f"max param grad {step['grad']:.1e} ({step['params_checked']} params), buffers {step['buffer']:.1e}"
            )
