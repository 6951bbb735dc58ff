"""recipes/train_gpt.py with Hugging Face models: the tiny Llama (grouped-query attention) and GPT-2 configs
under hybrid3d at world 2, a save_pretrained folder, and the settings refused before any worker starts."""

from __future__ import annotations

import math

import pytest
import torch
import transformers  # a test dependency: make install installs the hf extra
from recipe_runs import GPT
from recipe_runs import run_recipe as _run_recipe
from test_recipe_configs import compose_gpt

from lightning_parallel.recipes.gpt import check_config

SHORT = ["trainer=debug", "trainer.max_steps=6", "sample_tokens=8"]
UNIFORM = math.log(256)  # the loss of a uniform guess over the byte vocabulary, where training starts


def run_recipe(cwd, *overrides: str) -> dict:
    return _run_recipe(GPT, cwd, *SHORT, *overrides)


def assert_trained(got: dict, world: int) -> None:
    assert got["steps"] == 6 and got["layout"]["world_size"] == world
    assert math.isfinite(got["final_train_loss"]) and got["final_train_loss"] < UNIFORM - 0.5, got
    assert math.isfinite(got["final_val_loss"]) and len(got["sample"]) > 0


@pytest.mark.slow
def test_tiny_llama_trains_under_tensor_parallelism(tmp_path):
    got = run_recipe(tmp_path, "model=hf_llama_tiny", "strategy=hybrid3d", "strategy.tp=2", "trainer.devices=2")
    assert_trained(got, world=2)
    assert got["layout"]["tp"] == 2


def test_a_save_pretrained_folder_trains_from_its_weights(tmp_path):
    """model=hf model.path=FOLDER: the folder's weights (its loss at step 0 is theirs, not a fresh model's)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    got = run_recipe(tmp_path, "model=hf", f"model.path={tmp_path / 'llama'}")
    assert_trained(got, world=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=hf_llama_tiny", "model.vocab_size=128"], r"model.vocab_size=128 .* set model.vocab_size=256"),
        (["model=hf"], r"model=hf needs exactly one of model.path=FOLDER"),
        (["model=hf", "model.path=/nowhere"], r"model.path='/nowhere' is not a save_pretrained folder"),
        (["model=hf_gpt2_tiny", "model.seq_len=128"], r"model.seq_len=128 is longer than the model's 64 positions"),
        (["model=hf_llama_tiny", "model.config.model_type=lama"], r"model.config is not a valid transformers config"),
        (
            ["model=hf_llama_tiny", "+model.config.attn_implementation=flash_attention_2"],
            r"attn_implementation=flash_attention_2 runs on CUDA GPUs only, and this run is on CPU",
        ),
        (
            ["model=hf_llama_tiny", "strategy=hybrid3d", "strategy.tp=4", "trainer.devices=4"],
            r"tp=4 does not divide the model's num_key_value_heads=2",
        ),
        (
            ["model=hf_gpt2_tiny", "strategy=hybrid3d", "strategy.pp=8", "trainer.devices=8"],
            r"strategy.pp=8",  # 6 pipeline layers (2 blocks)
        ),
        (
            ["model=hf_llama_tiny", "strategy=hybrid3d", "strategy.cp=3", "trainer.devices=3"],
            r"strategy.cp=3 splits each sequence into 2 \* cp = 6 equal chunks .* does not divide by 6",
        ),
    ],
    ids=[
        "vocab",
        "no-source",
        "no-folder",
        "positions",
        "model-type",
        "flash-on-cpu",
        "tp-kv-heads",
        "pp-layers",
        "cp",
    ],
)
def test_bad_hf_settings_are_refused_before_workers(overrides, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        check_config(compose_gpt(*overrides))


def test_a_folder_with_weights_keeps_its_vocabulary(tmp_path):
    config = transformers.GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    check_config(compose_gpt("model=hf", f"model.path={tmp_path}"))  # 300 covers the bytes
    with pytest.raises(ValueError, match=r"model.vocab_size=256 differs from the vocab_size=300 of the weights"):
        check_config(compose_gpt("model=hf", f"model.path={tmp_path}", "model.vocab_size=256"))
