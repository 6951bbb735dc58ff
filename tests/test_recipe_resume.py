"""Checkpoints through the recipes: a run resumed from a mid-epoch sharded checkpoint continues exactly
(same losses, same final parameters and optimizer states as the run that never stopped), folders are kept
as configured, and a consolidated folder is an ordinary single-process checkpoint."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from test_recipe_gpt import SHORT, run_recipe

from lightning_parallel.checkpoint import consolidated

EVERY = 3
STEPS = 6  # the text corpus has hundreds of batches per epoch: both checkpoints are mid-epoch


def logged_losses(run_dir: Path) -> dict[int, float]:
    losses = {}
    for version in sorted((run_dir / "logs").glob("version_*")):
        with open(version / "metrics.csv") as f:
            for row in csv.DictReader(f):
                if row.get("train_loss"):
                    losses[int(row["step"])] = float(row["train_loss"])
    return losses


def assert_same_states(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        if torch.is_tensor(want[key]):
            assert torch.equal(got[key], want[key]), f"{what}: {key} differs"
        elif isinstance(want[key], dict):
            assert_same_states(got[key], want[key], f"{what}.{key}")


@pytest.mark.parametrize(
    "layout",
    [
        ["strategy=zero1", "trainer.devices=2"],
        ["strategy=zero3", "trainer.devices=2"],
        ["strategy=hybrid3d", "strategy.pp=2", "strategy.tp=2", "trainer.devices=4"],
    ],
    ids=["zero1", "zero3", "hybrid3d-pp2-tp2"],
)
def test_resumed_run_continues_exactly(layout, tmp_path):
    ckpt = ["checkpoint=periodic", f"checkpoint.every_n_steps={EVERY}", "checkpoint.keep_last=-1"]
    common = [*SHORT, f"trainer.max_steps={STEPS}", *ckpt, *layout]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = run_recipe(tmp_path / "a", *common)
    (middle,) = (tmp_path / "a" / "checkpoints").glob(f"*step={EVERY}.ckpt")
    assert middle.is_dir() and (middle / "meta.pt").is_file()
    resumed = run_recipe(tmp_path / "b", *common, f"ckpt_path='{middle}'")  # quoted: the name holds '='
    assert resumed["steps"] == whole["steps"] == STEPS
    want, got = logged_losses(tmp_path / "a" / "run"), logged_losses(tmp_path / "b" / "run")
    assert sorted(got) == list(range(EVERY, STEPS)), "the resumed run trains the steps after the checkpoint only"
    assert {s: want[s] for s in got} == got
    final_a = consolidated(tmp_path / "a" / "checkpoints" / "last.ckpt")
    final_b = consolidated(tmp_path / "b" / "checkpoints" / "last.ckpt")
    assert_same_states(final_b["state_dict"], final_a["state_dict"], "parameters")
    assert_same_states(final_b["optimizer_states"][0], final_a["optimizer_states"][0], "optimizer state")
