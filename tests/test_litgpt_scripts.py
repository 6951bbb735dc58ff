"""LitGPT's own full fine-tuning script (``litgpt.finetune.full.main``, unchanged) under this package's Fabric
strategies, on the tiny LitGPT checkpoint folder made locally: its logged loss at each optimizer step under zero3
(dp=2) and hybrid3d tp=2 equals the same script in one process under Lightning's own strategy, same seed, within
1e-5. (The script's own choice, Lightning's FSDPStrategy, needs an accelerator under torch 2.13: the one-process
reference is Lightning's DDP at world 1, whose data goes through the same DistributedSampler as ours.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Batch
from parity import assert_same_losses

from lightning_parallel.recipes.finetune_assets import make_default_assets

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


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


def test_gpu_check_litgpt_section_dry_run(tmp_path):
    """benchmarks/gpu_check's litgpt_fsdp section on CPU: the script under Lightning's own strategy (DDP here: its
    FSDPStrategy needs a GPU) and ours (ZeRO-3 over one rank), same losses; on a GPU the reference is FSDPStrategy."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--only", "litgpt_fsdp", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["litgpt_fsdp"]
    assert section["status"] == "ok", section.get("error")
    result = section["result"]
    assert len(result["lightning_losses"]) == result["steps"] == 5
    assert_same_losses(result["ours_losses"], result["lightning_losses"], "gpu_check litgpt_fsdp (dry run)")
    assert result["max_rel_diff"] <= 1e-5 and "## litgpt_fsdp" in (tmp_path / "gpu_check.md").read_text()
