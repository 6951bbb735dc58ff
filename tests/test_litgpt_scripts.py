"""LitGPT's own full fine-tuning script (``litgpt.finetune.full.main``, unchanged) under this package's Fabric
strategies, on the tiny LitGPT checkpoint folder made locally: its logged loss at each optimizer step under zero3
(dp=2) and hybrid3d tp=2 equals the same script in one process under Lightning's own strategy, same seed, within
1e-5. (The script's own choice, Lightning's FSDPStrategy, needs an accelerator under torch 2.13: the one-process
reference is Lightning's DDP at world 1, whose data goes through the same DistributedSampler as ours.)"""

from __future__ import annotations

import pytest
from conftest import Batch
from parity import assert_same_losses

from lightning_parallel.recipes.finetune_assets import make_default_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> Batch:
    assets = str(make_default_assets(tmp_path_factory.mktemp("assets") / "finetune")[0].parent)
    case = {"name": "full", "steps": 5, "global_batch": 4, "assets": assets}
    runs = {
        "reference": (1, "ddp", [case]),
        "zero3": (2, "zero3", [{**case, "dp": 2}]),
        "tp2": (2, "hybrid3d:tp=2", [case]),  # dp=1: the script's "devices" is 1
    }
    return Batch(tmp_path_factory, runs, tag="litgpt_scripts", worker="litgpt_script")


@pytest.mark.parametrize("label", ["zero3", "tp2"])
def test_litgpt_full_finetune_script_matches_one_process(scripts, label):
    run, ref = scripts[label], scripts["reference"]
    want = ref.case("full")["losses"]
    assert len(want) == 5
    # the script logs each rank's running mean over its micro-batches of the step: their mean is the step's loss
    assert_same_losses(run.losses("full"), want, f"litgpt finetune/full.py under {label}")
    for rank in range(2):
        assert run.case("full", rank)["saved"], f"{label} rank {rank}: the script's final fabric.save"
