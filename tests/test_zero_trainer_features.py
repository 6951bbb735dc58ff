"""Lightning features next to ZeRO: ModelCheckpoint on train_loss, CSV logging, test and predict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import launch
from parity import assert_same_losses

FEATURES = [{"name": "features", "steps": 6, "features": True}]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return launch(tmp_path_factory, "auto", 1, FEATURES)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_trainer_features(strategy, single, tmp_path_factory):
    run = launch(tmp_path_factory, strategy, 2, FEATURES)
    assert_same_losses(run.losses("features"), single.losses("features"), strategy)
    want = single.case("features")
    for rank in range(2):
        got = run.case("features", rank)
        assert abs(got["test_loss"] - want["test_loss"]) <= 1e-5 * want["test_loss"], f"rank {rank} test_loss"
        # each dp rank predicts its half of the data
        assert got["predicted_tokens"] * 2 == want["predicted_tokens"]
    best = Path(run.case("features")["best_checkpoint"])
    assert best.is_file(), "ModelCheckpoint(monitor='train_loss') saved nothing"
    ckpt = torch.load(best, weights_only=True)
    assert ckpt["state_dict"].keys() == single.params("features").keys()
    metrics = (run.out / "logs" / "version_0" / "metrics.csv").read_text()
    assert "train_loss" in metrics and "test_loss" in metrics
