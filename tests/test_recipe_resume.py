"""Checkpoints through the recipes: a run resumed from a mid-epoch sharded checkpoint continues exactly
(same losses, same final parameters and optimizer states as the run that never stopped), also one epoch
later, under every way of holding optimizer states (flat ZeRO-1/2 on the host, FSDP2, pipeline x tensor)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from recipe_runs import GPT, VGG, run_recipe
from test_recipe_gpt import SHORT as GPT_SHORT

from lightning_parallel.checkpoint import consolidated


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


def assert_resume_continues_exactly(script: Path, tmp_path: Path, every: int, steps: int, *args: str) -> None:
    """Run ``steps`` steps saving every ``every``; resume a second run from the first save; the resumed
    run's logged losses, final parameters and optimizer states equal the uninterrupted run's, bitwise.
    ``steps`` is a multiple of ``every``: both runs then write last.ckpt at the last step."""
    assert steps % every == 0
    ckpt = ["checkpoint=periodic", f"checkpoint.every_n_steps={every}", "checkpoint.keep_last=-1"]
    common = [*args, f"trainer.max_steps={steps}", *ckpt]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = run_recipe(script, tmp_path / "a", *common)
    (middle,) = (tmp_path / "a" / "checkpoints").glob(f"*step={every}.ckpt")
    resumed = run_recipe(script, tmp_path / "b", *common, f"ckpt_path='{middle}'")  # quoted: the name holds '='
    assert resumed["steps"] == whole["steps"] == steps
    want, got = logged_losses(tmp_path / "a" / "run"), logged_losses(tmp_path / "b" / "run")
    assert sorted(got) == list(range(every, steps)), "the resumed run trains the steps after the checkpoint only"
    assert {s: want[s] for s in got} == got
    final_a = consolidated(tmp_path / "a" / "checkpoints" / "last.ckpt")
    final_b = consolidated(tmp_path / "b" / "checkpoints" / "last.ckpt")
    assert_same_states(final_b["state_dict"], final_a["state_dict"], "parameters")
    assert_same_states(final_b["optimizer_states"][0], final_a["optimizer_states"][0], "optimizer state")


@pytest.mark.parametrize(
    "layout",
    [
        # slow tier (test budget): test_clean_exit's SIGTERM save-and-resume-bitwise run stays in `make test`
        pytest.param(["strategy=zero1", "trainer.devices=2"], marks=pytest.mark.slow),
        pytest.param(["strategy=zero2_offload", "trainer.devices=2"], marks=pytest.mark.slow),
        pytest.param(["strategy=zero3", "trainer.devices=2"], marks=pytest.mark.slow),
        pytest.param(
            ["strategy=hybrid3d", "strategy.pp=2", "strategy.tp=2", "trainer.devices=4"], marks=pytest.mark.slow
        ),
    ],
    ids=["zero1", "zero2-offload", "zero3", "hybrid3d-pp2-tp2"],
)
def test_resumed_run_continues_exactly(layout, tmp_path):
    """GPT: the text corpus has hundreds of batches per epoch, so the step-3 checkpoint is mid-epoch 0."""
    assert_resume_continues_exactly(GPT, tmp_path, 3, 6, *GPT_SHORT, *layout)


@pytest.mark.slow
def test_resume_in_a_later_epoch_continues_exactly(tmp_path):
    """VGG: 3 steps per epoch, the step-4 checkpoint is one batch into epoch 1: the sampler's epoch-1 order
    and the augmentation drawn for epoch 1 must both come back."""
    short = ["trainer=debug", "data.num_train=96", "data.num_val=32", "data.global_batch_size=32"]
    assert_resume_continues_exactly(VGG, tmp_path, 4, 8, *short, "strategy=zero2", "trainer.devices=2")


@pytest.mark.slow
def test_keep_last_under_a_pipeline(tmp_path):
    """checkpoint.keep_last counts every rank's vote: with pp=2 the dp axis is 1 rank of 2, and a vote summed
    over dp alone never reached the world size, so old step folders were never replaced."""
    args = [*GPT_SHORT, "strategy=hybrid3d", "strategy.pp=2", "trainer.devices=2", "trainer.max_steps=4"]
    run_recipe(GPT, tmp_path, *args, "checkpoint=periodic", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2")
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("*step=*.ckpt"))
    assert saved == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt"], saved
