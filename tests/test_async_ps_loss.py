"""Issue 32: under strategy=async_ps the recipe's ``final_train_loss`` is the global training loss (server 0's mean
of the workers' last pushes), equal to one process's at staleness 0, and its layout counts workers and servers
apart (the server is no data-parallel rank). Through the recipe, metrics.json."""

from __future__ import annotations

import pytest
from recipe_runs import GPT, run_recipe

COMMON = ["model=gpt_tiny", "trainer=debug", "trainer.max_steps=6", "sample_tokens=0", "trainer.logger=none"]
COMMON += ["data.global_batch_size=8", "trainer.val_check_interval=6"]


@pytest.mark.slow
def test_final_train_loss_is_the_global_loss_at_staleness_0(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "ps").mkdir()
    one = run_recipe(GPT, tmp_path / "one", *COMMON, "trainer.devices=1")
    ps = run_recipe(GPT, tmp_path / "ps", *COMMON, "strategy=async_ps", "trainer.devices=3", timeout=600)
    # before: one worker's loss on its half of the batch (1.4e-2 away); the validation loss always matched
    assert ps["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-5)
    assert ps["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-5)
    layout = ps["layout"]
    assert (layout["dp"], layout["workers"], layout["servers"], layout["world_size"]) == (2, 2, 1, 3)
