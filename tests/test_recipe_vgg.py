"""recipes/train_vgg.py end to end: the default data, CIFAR-10 from a folder, and the same training under
other layouts (BatchNorm statistics synced over dp make data parallelism exact)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from recipe_runs import VGG, assert_fails_before_workers, default_run_metrics, run
from recipe_runs import run_recipe as _run_recipe
from test_recipe_configs import compose_vgg

from lightning_parallel.models.vgg import VGG as VGGNet
from lightning_parallel.recipes.vgg import vgg_config

SHORT = ["trainer=debug", "trainer.max_steps=6", "data.num_train=512", "data.num_val=64", "data.global_batch_size=32"]


def run_recipe(cwd: Path, *overrides: str, timeout: int = 300) -> dict:
    return _run_recipe(VGG, cwd, *overrides, timeout=timeout)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_recipe(tmp_path_factory.mktemp("single"), *SHORT, "trainer.sync_batchnorm=true")


def test_single_process_run_writes_its_metrics(single):
    """Six steps only (learning shows in the default command's test): the reference for the layouts below."""
    assert single["steps"] == 6 and single["layout"]["world_size"] == 1
    assert 1.0 < single["final_train_loss"] < 3.0  # about ln 10 = 2.303, a uniform guess over 10 classes
    assert single["final_val_loss"] is not None and 0.0 <= single["final_val_accuracy"] <= 1.0
    assert single["throughput_unit"] == "samples/s" and single["throughput"] > 0
    with torch.device("meta"):
        params = sum(p.numel() for p in VGGNet(vgg_config(compose_vgg(*SHORT).model)).parameters())
    assert (single["trainable_params"], single["frozen_params"]) == (params, 0)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["strategy=ddp", "trainer.devices=2"], marks=pytest.mark.slow),
        pytest.param(["strategy=zero3", "trainer.devices=2"], marks=pytest.mark.slow),
        pytest.param(["strategy=hybrid3d", "strategy.tp=2", "trainer.devices=4"], marks=pytest.mark.slow),
        # one microbatch: BatchNorm sees each step's whole batch, as in one process
        pytest.param(
            [
                "strategy=hybrid3d",
                "strategy.pp=2",
                "strategy.pp_schedule=gpipe",
                "strategy.microbatches=1",
                "trainer.devices=2",
            ],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["ddp-2", "zero3-2", "hybrid3d-dp2-tp2", "hybrid3d-pp2"],
)
def test_synced_batchnorm_makes_other_layouts_the_same_training(overrides, single, tmp_path):
    got = run_recipe(tmp_path, *SHORT, "trainer.sync_batchnorm=true", *overrides)
    want = single["final_train_loss"]
    assert abs(got["final_train_loss"] - want) <= 1e-5 * want, (got["final_train_loss"], want)
    assert got["layout"]["world_size"] == len(got["peak_memory_bytes"]) == int(overrides[-1].split("=")[1])


def write_cifar10(folder: Path, per_batch: int = 40) -> None:
    """A small CIFAR-10 in the real format: pickled dicts with bytes keys, uint8 rows of 3072 bytes."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        labels = [int(x) for x in rng.integers(0, 10, per_batch)]
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data, b"filenames": [b"x.png"] * per_batch}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=4)  # a Python 3 re-save (tests/test_image_data.py writes Python 2 files)


@pytest.mark.slow
def test_cifar10_from_a_local_folder(tmp_path):
    write_cifar10(tmp_path / "cifar-10-batches-py")
    overrides = ["data=cifar10", f"data.path={tmp_path}", "data.global_batch_size=32", "trainer=debug"]
    got = run_recipe(tmp_path, *overrides, "trainer.max_steps=3", "strategy=ddp", "trainer.devices=2")
    assert got["steps"] == 3 and got["layout"]["world_size"] == 2
    assert np.isfinite(got["final_train_loss"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # the same checks run in-process in test_bad_input_catalogue: one subprocess here in `make test`
        pytest.param(
            ["data=cifar10", "data.path=/no/such/folder"],
            "data.path='/no/such/folder' is not a folder",
            marks=pytest.mark.slow,
        ),
        pytest.param(["data=cifar10"], "data=cifar10 needs data.path", marks=pytest.mark.slow),
        (["strategy=hybrid3d", "strategy.tp=2", "model.width=3"], "tp=2 does not divide features.0.conv"),
        pytest.param(["model.lr_schedule=linear"], "model.lr_schedule='linear' is unknown", marks=pytest.mark.slow),
    ],
    ids=["missing-folder", "no-path", "tp-channels", "lr-schedule"],
)
def test_bad_override_fails_before_any_worker_starts(tmp_path, overrides, message):
    assert_fails_before_workers(VGG, tmp_path, *overrides, "trainer=debug", "trainer.devices=2", message=message)


@pytest.mark.slow  # 200 steps; test_single_process_run_writes_its_metrics runs the same path shortened
def test_the_readme_default_command_runs_as_written(tmp_path):
    """`python recipes/train_vgg.py`: VGG11 (vgg_tiny) on generated images, 200 steps, seconds on a CPU."""
    run(tmp_path, VGG, timeout=600)
    got = default_run_metrics(tmp_path)
    assert got["steps"] == 200 and got["final_val_loss"] < 1.5  # from ln 10 = 2.3, a uniform guess
    assert got["final_val_accuracy"] > 0.5  # chance is 0.1
