"""The README's bring-your-own-model example: one unchanged module under auto, ddp and hybrid3d pp x tp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Batch
from parity import assert_same_losses, assert_same_params

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "byo_model.py"
BYO_CASES = [
    {"name": "byo", "model": "byo", "steps": 10, "validate": True},
    {"name": "byo_clip_accumulate", "model": "byo", "steps": 10, "clip": 0.05, "accumulate": 2},
]


LAYOUTS = [
    ("ddp", 2, 2),
    ("hybrid3d:pp=2,tp=2,zero_stage=1", 4, 1),
    ("hybrid3d:pp=2,dp=2,pp_schedule=zero_bubble", 4, 2),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    runs = {strategy: (world, strategy, BYO_CASES) for strategy, world, _ in LAYOUTS}
    return Batch(tmp_path_factory, {**runs, "single": (1, "auto", BYO_CASES)}, tag="byo")


@pytest.mark.parametrize(
    ("strategy", "world", "dp"),
    [pytest.param(*layout, marks=pytest.mark.slow) if layout[1] > 2 else layout for layout in LAYOUTS],
)
def test_byo_model_parity(strategy, world, dp, runs):
    run, single = runs[strategy], runs["single"]
    tp = world // dp // (2 if "pp=2" in strategy else 1)
    leaders = [d * tp for d in range(dp)]
    for case in BYO_CASES:
        name = case["name"]
        loss_rel = assert_same_losses(run.losses(name, leaders), single.losses(name), f"{strategy} {name}")
        param_abs = assert_same_params(run.params(name), single.params(name), f"{strategy} {name}")
        print(f"{strategy} {name}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")
    want = single.case("byo")["val_loss"]
    for rank in range(world):
        assert abs(run.case("byo", rank)["val_loss"] - want) <= 1e-5 * want, f"{strategy} rank {rank} val_loss"


@pytest.mark.slow  # a real launch of 4 processes; test_byo_model_parity runs the same module under every layout
def test_readme_command_runs(tmp_path):
    """`python examples/byo_model.py --strategy hybrid3d --pp 2 --tp 2 --devices 4`, shortened."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(EXAMPLE), "--strategy", "hybrid3d", "--pp", "2", "--tp", "2", "--devices", "4"]
    result = subprocess.run([*cmd, "--steps", "10"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=10` reached" in result.stdout + result.stderr
