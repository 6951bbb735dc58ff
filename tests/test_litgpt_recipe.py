"""recipes/train_gpt.py with LitGPT's GPT: ``model=litgpt`` (Pythia-14m cut to 2 layers) under hybrid3d at
world 2, a litgpt checkpoint folder, and the settings refused before any worker starts."""

from __future__ import annotations

import math

import pytest
import torch
from litgpt.config import Config  # a test dependency: make install installs litgpt
from litgpt.model import GPT
from litgpt.utils import save_config
from recipe_runs import GPT as GPT_RECIPE
from recipe_runs import run_recipe as _run_recipe
from test_recipe_configs import compose_gpt

from lightning_parallel.recipes.gpt import check_config

SHORT = ["trainer=debug", "trainer.max_steps=6", "sample_tokens=8"]
UNIFORM = math.log(256)


def run_recipe(cwd, *overrides: str) -> dict:
    return _run_recipe(GPT_RECIPE, cwd, *SHORT, *overrides)


@pytest.mark.slow
def test_named_litgpt_trains_under_pipeline_and_tensor_parallelism(tmp_path):
    got = run_recipe(tmp_path, "model=litgpt", "strategy=hybrid3d", "strategy.pp=2", "trainer.devices=2")
    assert got["steps"] == 6 and got["layout"]["pp"] == 2 and got["layout"]["world_size"] == 2
    assert math.isfinite(got["final_train_loss"]) and got["final_train_loss"] < UNIFORM - 0.5, got
    assert math.isfinite(got["final_val_loss"]) and len(got["sample"]) > 0


def test_a_litgpt_checkpoint_folder_trains_from_its_weights(tmp_path):
    config = Config.from_name("pythia-14m", n_layer=2, block_size=64, vocab_size=256, padded_vocab_size=256)
    folder = tmp_path / "lit"
    folder.mkdir()
    save_config(config, folder)  # model_config.yaml, as litgpt writes it
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), folder / "lit_model.pth")
    got = run_recipe(tmp_path, "model=litgpt", "model.name=null", f"model.path={folder}")
    assert got["steps"] == 6 and math.isfinite(got["final_train_loss"]), got
    with pytest.raises(ValueError, match=r"holds lm_head.weight of shape \(256, 128\), but .* make it \(256, 64\)"):
        check_config(compose_gpt("model=litgpt", "model.name=null", f"model.path={folder}", "+model.config.n_embd=64"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.vocab_size=128"], r"model.vocab_size=128 .* set model.vocab_size=256"),
        (["model.path=/somewhere"], r"model=litgpt needs exactly one of model.name .* and model.path"),
        (["model.name=null", "model.path=/nowhere"], r"model.path='/nowhere' is not a litgpt checkpoint folder"),
        (["model.seq_len=128"], r"model.seq_len=128 is longer than the model's block_size=64"),
        (["model.name=no-such-model"], r"model=litgpt: .*no-such-model"),
        (["strategy=hybrid3d", "strategy.tp=8", "trainer.devices=8"], r"tp=8 does not divide the model's n_head=4"),
        (["strategy=hybrid3d", "strategy.pp=4", "trainer.devices=4"], r"pp=4 is more pipeline stages than"),
    ],
    ids=["vocab", "both", "no-folder", "block-size", "name", "tp-heads", "pp-layers"],
)
def test_bad_litgpt_settings_are_refused_before_workers(overrides, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        check_config(compose_gpt("model=litgpt", *overrides))
