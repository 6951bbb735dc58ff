"""Lightning features next to ZeRO and pipelines: ModelCheckpoint on train_loss, CSV logging (the logged
loss is the single-process loss), test and predict."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from conftest import Batch
from parity import assert_same_losses

from lightning_parallel.checkpoint import consolidated

FEATURES = [{"name": "features", "steps": 6, "features": True}]


LAYOUTS = [("zero2", 2), ("zero3", 2), ("hybrid3d:pp=2", 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    runs = {strategy: (2, strategy, FEATURES) for strategy, _ in LAYOUTS}
    return Batch(tmp_path_factory, {**runs, "single": (1, "auto", FEATURES)}, tag="features")


@pytest.mark.parametrize(("strategy", "dp"), LAYOUTS)
def test_trainer_features(strategy, dp, runs):
    run, single = runs[strategy], runs["single"]
    assert_same_losses(run.losses("features", list(range(dp))), single.losses("features"), strategy)
    want = single.case("features")
    for rank in range(2):
        got = run.case("features", rank)
        assert abs(got["test_loss"] - want["test_loss"]) <= 1e-5 * want["test_loss"], f"rank {rank} test_loss"
        # each dp rank predicts its share of the data
        assert got["predicted_tokens"] * dp == want["predicted_tokens"]
    best = Path(run.case("features")["best_checkpoint"])
    assert (best / "meta.pt").is_file(), "ModelCheckpoint(monitor='train_loss') saved no sharded folder"
    ckpt = consolidated(best)
    assert ckpt["state_dict"].keys() == single.params("features").keys()
    metrics = (run.out / "logs" / "version_0" / "metrics.csv").read_text()
    assert "train_loss" in metrics and "test_loss" in metrics
    # what rank 0 logged (the progress bar shows the same) is the single-process loss of each step
    logged = [float(row["train_loss"]) for row in csv.DictReader(metrics.splitlines()) if row.get("train_loss")]
    assert_same_losses(logged, single.losses("features"), f"{strategy} logged train_loss")
