"""Strategy presets from one table (strategies/presets.py): each row is a name in the Trainer's registry, in Fabric's
and a Hydra option of the recipes, with the row's settings; a recipe run under a preset trains like one process."""

from __future__ import annotations

import pytest
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from recipe_runs import GPT, run_recipe
from test_recipe_configs import compose_gpt

import lightning_parallel  # noqa: F401  (registers the names)
from lightning_parallel.fabric import Hybrid3DFabricStrategy, ZeroFabricStrategy
from lightning_parallel.recipes.common import build_strategy
from lightning_parallel.strategies import Hybrid3DStrategy, ZeroStrategy
from lightning_parallel.strategies.presets import PRESETS, Preset, presets_of

DOORS = {"hybrid3d": (Hybrid3DStrategy, Hybrid3DFabricStrategy), "zero": (ZeroStrategy, ZeroFabricStrategy)}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_is_a_name_of_both_front_doors_and_of_the_recipes(name):
    preset = PRESETS[name]
    trainer_cls, fabric_cls = DOORS[preset.strategy]
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    fabric = Fabric(strategy=name, accelerator="cpu", devices=2)
    assert type(trainer.strategy) is trainer_cls and type(fabric.strategy) is fabric_cls
    for config in (trainer.strategy.runtime.config, fabric.strategy.runtime.config):
        assert {key: getattr(config, key) for key in preset.settings} == preset.settings, name
    cfg = compose_gpt(f"strategy={name}", "trainer.devices=2")
    assert cfg.strategy.name == preset.recipe_name()
    assert {key: cfg.strategy[key] for key in preset.settings} == preset.settings
    assert type(build_strategy(cfg.strategy)) is trainer_cls  # the recipe builds what the Trainer's name gives


def test_a_preset_of_an_unknown_strategy_is_refused(monkeypatch):
    monkeypatch.setitem(PRESETS, "ddp_fast", Preset("ddp", {}))
    with pytest.raises(ValueError, match=r"Preset\(strategy='ddp'\) is unknown: use 'hybrid3d' or 'zero'"):
        presets_of("hybrid3d")


def test_a_zero_preset_passes_its_stage_as_the_strategy_s_own_argument():
    preset = Preset("zero", {"zero_stage": 3, "dp_shard": 2})
    assert preset.init_params() == {"stage": 3, "offload": False, "dp_shard": 2}
    assert preset.recipe_name() == "zero3"
    assert Preset("zero", {"zero_stage": 2, "offload": True}).recipe_name() == "zero2_offload"


@pytest.mark.slow
def test_the_recipe_under_hybrid3d_pp2_trains_like_one_process(tmp_path):
    short = ["trainer=debug", "trainer.max_steps=4", "sample_tokens=0"]
    for folder in ("one", "pp2"):
        (tmp_path / folder).mkdir()
    single = run_recipe(GPT, tmp_path / "one", *short)
    got = run_recipe(GPT, tmp_path / "pp2", *short, "strategy=hybrid3d_pp2", "trainer.devices=2")
    assert got["layout"]["pp"] == 2 and got["layout"]["world_size"] == 2
    want = single["final_train_loss"]
    assert abs(got["final_train_loss"] - want) <= 1e-5 * want, (got["final_train_loss"], want)
