"""Every config of every group composes against its schema and builds what it names."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

import lightning_parallel  # noqa: F401
from lightning_parallel.models import GPTConfig
from lightning_parallel.plugins.float8 import Float8Precision, float8_plugin
from lightning_parallel.recipes.auto import resolve_auto
from lightning_parallel.recipes.common import build_strategy, build_trainer, micro_batch_size
from lightning_parallel.recipes.config import register_configs
from lightning_parallel.recipes.dpo_config import register_dpo_configs
from lightning_parallel.recipes.finetune_assets import make_default_assets
from lightning_parallel.recipes.model_kinds import kind_of
from lightning_parallel.recipes.vgg import scaled_lr

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["strategy", "precision", "model", "data", "trainer", "checkpoint", "peft", "optimizer"]

register_configs()
register_dpo_configs()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def recipe_of(group: str, option: str) -> str:
    """The recipe an option belongs to: model/ and data/ options extend one recipe's schema (the fine-tuning
    recipe's: its default model folder, the tokenized data)."""
    text = (CONF / group / f"{option}.yaml").read_text()
    if "preference_schema" in text:
        return "dpo"
    if "${assets}" in text or "tokenized_schema" in text:
        return "finetune"
    return "train_vgg" if "vgg_schema" in text or "images_schema" in text else "train_gpt"


@functools.cache
def finetune_assets() -> Path:
    """The fine-tuning recipe's default model and instruction set, made once for these tests."""
    folder = Path(tempfile.mkdtemp(prefix="finetune-assets-")) / "finetune"
    make_default_assets(folder)
    return folder


def compose_recipe(recipe: str, *overrides: str):
    if recipe in ("finetune", "dpo") and not any(o.startswith("assets=") for o in overrides):
        overrides = (f"assets={finetune_assets()}", *overrides)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=recipe, overrides=list(overrides))


def compose_gpt(*overrides: str):
    return compose_recipe("train_gpt", *overrides)


def compose_vgg(*overrides: str):
    return compose_recipe("train_vgg", *overrides)


def build_model(cfg) -> None:
    """The model family's checks and its module on the meta device (model=hf names no model until model.path:
    test_hf_recipe); LoRA adapters included with peft=lora."""
    kind = kind_of(cfg.model)  # every conf/model file names its kind
    if kind.name == "hf" and cfg.model.path is None and not cfg.model.config:
        return
    kind.check(cfg)
    kind.meta_module(cfg)


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_builds(group, option):
    overrides = [f"{group}={option}"] + (["data.path=/nowhere"] if option in ("cifar10", "hf_text") else [])
    overrides += ["model=hf_llama_tiny"] if group == "peft" else []  # adapters go on model=hf* (test_recipe_peft)
    overrides += ["trainer.devices=2"] if (group, option) == ("strategy", "auto") else []
    cfg = compose_recipe(recipe_of(group, option), *overrides)
    build_model(cfg)
    resolve_auto(cfg)  # strategy=auto: the planner's hybrid3d layout (tests/test_auto_strategy.py)
    strategy = build_strategy(cfg.strategy)
    devices = max(cfg.trainer.devices, 8 if group == "strategy" and option.startswith("hybrid3d_") else 2)
    precision, plugins = cfg.precision.value, None
    if precision == "fp8":  # a plugin, not a Lightning flag (the recipe's build_trainer: tests below)
        precision, plugins = None, [float8_plugin(cfg.precision, "cpu")]
    pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision=precision, plugins=plugins, logger=False
    )
    assert micro_batch_size(cfg, devices) >= 1


@pytest.mark.parametrize("strategy", options("strategy"))
def test_every_precision_builds_with_every_strategy(strategy, tmp_path):
    devices = 8 if strategy.startswith("hybrid3d_") else 2
    for precision in options("precision"):
        if strategy == "async_ps" and precision not in ("32-true", "bf16-mixed"):
            continue  # refused before launch (test_bad_input_catalogue: async-recipe-fp16, async-half-weights)
        if strategy == "ddp" and precision == "fp8":
            continue  # refused before launch (tests/test_fp8.py)
        cfg = compose_gpt(f"strategy={strategy}", f"precision={precision}", f"trainer.devices={devices}")
        cfg.trainer.accelerator = "cpu"
        resolve_auto(cfg)
        trainer = build_trainer(cfg, tmp_path)  # the recipe's own Trainer (its precision plugin included)
        if precision == "fp8":  # float8 Linear layers over bf16-mixed
            assert isinstance(trainer.precision_plugin, Float8Precision), strategy
        elif strategy != "ddp":  # ours keep fp16 on CPU; Lightning's ddp switches it to bf16
            assert getattr(trainer.precision_plugin, "precision", "32-true") == precision, f"{strategy} {precision}"


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes(experiment):
    cfg = compose_recipe("train_vgg" if "vgg" in experiment else "train_gpt", f"+experiment={experiment}")
    build_model(cfg)
    pl.Trainer(accelerator="cpu", devices=cfg.trainer.devices, strategy=build_strategy(cfg.strategy), logger=False)


@pytest.mark.parametrize("recipe", ["train_gpt", "train_vgg", "finetune", "dpo"])
def test_each_recipe_composes_with_its_defaults(recipe):
    cfg = compose_recipe(recipe)
    build_model(cfg)
    assert cfg.trainer.devices == 1 and cfg.strategy.name == "ddp"
    if recipe == "finetune":  # a tiny Llama with a tokenizer, data=sft, LoRA
        assert cfg.data.kind == "sft" and cfg.peft.method == "lora" and cfg.model.path.startswith(cfg.assets)
    if recipe == "dpo":  # the same tiny Llama, preference pairs, LoRA (the reference: adapters off)
        assert cfg.data.kind == "preference" and cfg.peft.method == "lora" and cfg.dpo.beta == 0.1


def test_a_model_of_the_other_recipe_is_refused_while_composing():
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ValidationError)):
        compose_gpt("model=vgg11")


def test_vgg_learning_rate_scales_linearly_with_the_global_batch():
    cfg = compose_vgg("model.lr=0.1", "model.lr_reference_batch=256", "data.global_batch_size=1024")
    assert scaled_lr(cfg) == pytest.approx(0.4)
    assert scaled_lr(compose_vgg("model.lr=0.1", "model.lr_reference_batch=null")) == 0.1


def test_bad_settings_name_the_key_and_the_fix():
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'strategy.tp'") as refused:
        compose_gpt("strategy=zero2", "strategy.tp=2")
    assert "set strategy=hybrid3d for pp, tp" in str(refused.value.__cause__)
    cfg = compose_gpt("strategy=hybrid3d", "strategy.tp=2", "data.global_batch_size=6")
    with pytest.raises(ValueError, match=r"data.global_batch_size=6 does not split over dp=4"):
        micro_batch_size(cfg, 8)


def test_model_warmup_raises_the_learning_rate_linearly():
    from lightning_parallel.models import GPTModule

    cfg = compose_gpt("model=gpt_tiny", "model.warmup_steps=4", "model.lr=1.0")
    model = GPTModule(GPTConfig(n_layer=1), lr=cfg.model.lr, warmup_steps=cfg.model.warmup_steps)
    conf = model.configure_optimizers()
    optimizer, scheduler = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=zero2", "strategy.microbatches=4"], "Key 'microbatches' not in 'the keys of strategy=zero1..3"),
        (["strategy=ddp", "strategy.sharding.offload=true"], "Key 'sharding' not in 'the keys of strategy=ddp"),
        (["strategy=hybrid3d", "strategy.staleness=1"], "Key 'staleness' not in 'the keys of strategy=hybrid3d"),
        (["strategy=async_ps", "strategy.tp=2"], "Key 'tp' not in 'the keys of strategy=async_ps"),
        (["strategy=zero2", "strategy.simulate=true"], "Key 'simulate' not in 'the keys of strategy=zero1..3"),
    ],
)
def test_settings_a_strategy_would_ignore_are_refused_by_its_schema(overrides, message):
    with pytest.raises(ConfigCompositionException) as refused:
        compose_gpt(*overrides)
    assert message in str(refused.value.__cause__)


def test_a_checkpoint_dir_without_a_period_is_refused():
    from lightning_parallel.recipes.gpt import check_config

    with pytest.raises(ValueError, match=r"checkpoint.every_n_steps=0 would save nothing"):
        check_config(compose_gpt("checkpoint.dir=ckpts"))


def test_vgg_warmup_then_cosine_decay():
    from lightning_parallel.models.lit_vgg import lr_factor

    seen = [lr_factor(step, warmup_steps=2, total_steps=6, schedule="cosine") for step in range(7)]
    assert seen[:3] == [0.5, 1.0, 1.0] and seen[-1] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(seen[1:], seen[2:]))  # never rises after warmup
    assert [lr_factor(s, 0, 6, "constant") for s in range(6)] == [1.0] * 6


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("train_gpt", ["trainer.sync_batchnorm=true"], r"the GPT has no BatchNorm to sync"),
        ("train_vgg", ["model.optimizer=lamb"], r"model.optimizer='lamb' is unknown"),
        ("train_vgg", ["data=cifar10", "data.path=/x", "data.num_train=512"], r"data.num_train=512 sizes"),
    ],
)
def test_settings_a_recipe_would_ignore_are_refused(recipe, overrides, message):
    from lightning_parallel.recipes import gpt, vgg

    check = gpt.check_config if recipe == "train_gpt" else vgg.check_config
    with pytest.raises(ValueError, match=message):
        check(compose_recipe(recipe, *overrides))
