"""The recipes' model families as registered entries (recipes/model_kinds.py) and the one check before launch:
every conf/model file names its kind, an old config's kind is inferred once (or refused naming model.kind=), a
family registered by the user is built and checked through its entry (by name, or by import path as the workers
find it), and the strategy's check runs once in the parent, not again in a worker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.models import GPTConfig, GPTModule
from lightning_parallel.recipes import gpt, vgg
from lightning_parallel.recipes.config import GPTModelConf, register_configs
from lightning_parallel.recipes.gpt_model import build_gpt_module, check_gpt_model
from lightning_parallel.recipes.model_kinds import (
    MODEL_KINDS,
    ModelKind,
    infer_kind,
    model_kind,
    register_model_kind,
    resolve_model_kind,
)
from lightning_parallel.strategies import runtime
from lightning_parallel.strategies.checks import check_model, checked_before_launch

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()
CALLS: list[str] = []


def compose_recipe(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def _check_wide(cfg) -> None:
    CALLS.append(cfg.model.kind)
    check_gpt_model(cfg)


@dataclass
class WideGPTConf(GPTModelConf):
    kind: str = "wide_gpt_test"
    d_model: int = 256


WIDE = ModelKind("wide_gpt_test", recipe="text", build=build_gpt_module, check=_check_wide, schema=WideGPTConf)
# found by its import path (model.kind=test_model_kinds.BY_PATH), as a spawned worker would find it
BY_PATH = ModelKind("by_path_test", recipe="text", build=build_gpt_module, check=_check_wide, vocab_size=len)


def test_every_model_file_names_a_registered_kind():
    for path in sorted((CONF / "model").glob("*.yaml")):
        raw = OmegaConf.load(path)
        assert raw.kind in MODEL_KINDS, path.name
        assert f"{raw.kind}_schema" in raw.defaults, path.name  # its kind and its schema agree


def test_an_old_config_without_its_kind_is_inferred_once_and_written():
    cfg = OmegaConf.create(OmegaConf.to_container(compose_recipe("train_gpt", "model=hf_llama_tiny")))  # as saved
    OmegaConf.set_struct(cfg, True)
    with open_dict(cfg):
        del cfg.model["kind"]
    assert infer_kind(cfg.model) == "hf"
    assert resolve_model_kind(cfg, "text") is MODEL_KINDS["hf"] and cfg.model.kind == "hf"  # the workers read it
    for model, kind in (("litgpt", "litgpt"), ("gpt_tiny", "gpt")):
        old = OmegaConf.create({k: v for k, v in compose_recipe("train_gpt", f"model={model}").model.items()})
        del old["kind"]
        assert infer_kind(old) == kind
    with pytest.raises(ValueError, match=r"no model.kind .* set model.kind= one of gpt, vgg, hf, litgpt"):
        infer_kind(OmegaConf.create({"seq_len": 64, "lr": 0.1}))


def test_unknown_kinds_and_another_recipes_family_are_refused():
    with pytest.raises(ValueError, match=r"model.kind='nope' is unknown: use one of gpt, vgg, hf, litgpt"):
        gpt.check_config(compose_recipe("train_gpt", "model.kind=nope"))
    with pytest.raises(ValueError, match=r"model.kind=gpt is trained by recipes/train_gpt.py"):
        vgg.check_config(compose_recipe("train_vgg", "model.kind=gpt", "+model.n_layer=2"))
    with pytest.raises(ValueError, match=r"model.kind='gpt' is registered already"):
        register_model_kind(ModelKind("gpt", recipe="text", build=build_gpt_module, check=check_gpt_model))


def test_a_registered_family_is_checked_and_built_through_its_entry():
    register_model_kind(WIDE)
    assert model_kind("wide_gpt_test") is WIDE
    CALLS.clear()
    gpt.check_config(compose_recipe("train_gpt", "model.kind=wide_gpt_test"))
    assert CALLS == ["wide_gpt_test"]
    kind = model_kind("test_model_kinds.BY_PATH")  # imported, then registered under its name
    assert kind.name == "by_path_test" and model_kind("by_path_test") is kind
    CALLS.clear()
    gpt.check_config(compose_recipe("train_gpt", "model.kind=test_model_kinds.BY_PATH"))
    assert CALLS == ["test_model_kinds.BY_PATH"]


def test_the_strategy_check_runs_once_before_launch_and_not_in_the_workers(monkeypatch):
    seen = []
    # the strategy's one check, where its runtime calls it
    monkeypatch.setattr(runtime, "check_model", lambda module, config, dims: seen.append((type(module), dims.tp)))
    gpt.check_config(compose_recipe("train_gpt", "strategy=hybrid3d", "strategy.tp=2", "trainer.devices=2"))
    assert seen == [(GPTModule, 2)]  # the module the workers train, checked against the job's degrees
    module = GPTModule(GPTConfig(n_head=3, d_model=48), build_in_configure_model=True)  # tp=2 cannot split 3 heads
    strategy = Hybrid3DStrategy(tp=2)
    checked_before_launch(module, strategy.config)  # what a recipe's worker says of its module
    check_model(module, strategy.config, strategy.config.dims(2))  # nothing to repeat
    with pytest.raises(ValueError, match=r"tp=2 does not divide GPTConfig.n_head=3"):
        check_model(module, Hybrid3DStrategy(tp=2, sequence_parallel=True).config, strategy.config.dims(2))


def test_a_family_in_its_own_recipes_module_is_found_with_no_line_elsewhere(tmp_path, monkeypatch):
    """recipes/<name>_model.py registers its family on import; model_kinds imports every such module (the newcomer
    task: a model file, this module and a YAML), and register_configs stores its schema before Hydra composes."""
    import sys

    from hydra.core.config_store import ConfigStore

    from lightning_parallel import recipes
    from lightning_parallel.recipes.model_kinds import discover_model_kinds
    from lightning_parallel.recipes.model_kinds import register_configs as register_with_families

    (tmp_path / "probe_test_model.py").write_text(
        "from lightning_parallel.recipes.gpt_model import build_gpt_module, check_gpt_model\n"
        "from lightning_parallel.recipes.model_kinds import ModelKind, register_model_kind\n"
        "from test_model_kinds import WideGPTConf\n\n"
        "PROBE = register_model_kind(\n"
        "    ModelKind('probe_test', 'text', build=build_gpt_module, check=check_gpt_model, schema=WideGPTConf)\n"
        ")\n"
    )
    monkeypatch.setattr(recipes, "__path__", [*recipes.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "lightning_parallel.recipes.probe_test_model", raising=False)
    try:
        assert "probe_test" not in MODEL_KINDS
        discover_model_kinds()
        assert model_kind("probe_test").name == "probe_test"
        ConfigStore.instance().repo["model"].pop("probe_test_schema.yaml", None)
        register_with_families()
        assert "probe_test_schema.yaml" in ConfigStore.instance().repo["model"]
    finally:
        MODEL_KINDS.pop("probe_test", None)
        ConfigStore.instance().repo["model"].pop("probe_test_schema.yaml", None)
        sys.modules.pop("lightning_parallel.recipes.probe_test_model", None)
