"""Every config of every group composes against its schema and builds what it names."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

import lightning_parallel  # noqa: F401
from lightning_parallel.models import GPTConfig
from lightning_parallel.recipes.config import register_configs
from lightning_parallel.recipes.train import build_strategy, micro_batch_size

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["strategy", "precision", "model", "data", "trainer", "checkpoint"]

register_configs()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_gpt(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train_gpt", overrides=list(overrides))


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_builds(group, option):
    cfg = compose_gpt(f"{group}={option}")
    GPTConfig(**{k: cfg.model[k] for k in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "dropout")})
    strategy = build_strategy(cfg.strategy)
    devices = max(cfg.trainer.devices, 8 if group == "strategy" and option.startswith("hybrid3d_") else 2)
    if cfg.precision.value in ("32-true", "bf16-mixed") or strategy == "ddp":
        pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=cfg.precision.value, logger=False)
    assert micro_batch_size(cfg, devices) >= 1


@pytest.mark.parametrize("experiment", [p.stem for p in (CONF / "experiment").glob("*.yaml")])
def test_every_experiment_composes(experiment):
    cfg = compose_gpt(f"+experiment={experiment}")
    pl.Trainer(accelerator="cpu", devices=cfg.trainer.devices, strategy=build_strategy(cfg.strategy), logger=False)


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("strategy.tpp=2", ConfigCompositionException),  # a misspelled key
        ("strategy.tp=two", ConfigCompositionException),  # a wrong type
        ("strategy=fsdp9", ConfigCompositionException),  # an option that does not exist
    ],
)
def test_bad_overrides_fail_while_composing(override, error):
    with pytest.raises((error, ConfigKeyError, ValidationError)):
        compose_gpt(override)


def test_bad_settings_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"strategy.tp=2 needs strategy=hybrid3d"):
        build_strategy(compose_gpt("strategy=zero2", "strategy.tp=2").strategy)
    cfg = compose_gpt("strategy=hybrid3d", "strategy.tp=2", "data.global_batch_size=6")
    with pytest.raises(ValueError, match=r"data.global_batch_size=6 does not split over dp=4"):
        micro_batch_size(cfg, 8)


def test_model_warmup_raises_the_learning_rate_linearly():
    from lightning_parallel.models import LitGPT

    cfg = compose_gpt("model=gpt_tiny", "model.warmup_steps=4", "model.lr=1.0")
    model = LitGPT(GPTConfig(n_layer=1), lr=cfg.model.lr, warmup_steps=cfg.model.warmup_steps)
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
        (["strategy=zero2", "strategy.microbatches=4"], r"strategy.microbatches=4 needs strategy=hybrid3d"),
        (["strategy=ddp", "strategy.offload=true"], r"strategy=ddp keeps no state on the host"),
    ],
)
def test_settings_a_strategy_would_ignore_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_strategy(compose_gpt(*overrides).strategy)


def test_a_checkpoint_dir_without_a_period_is_refused():
    from lightning_parallel.recipes.train import check_config

    with pytest.raises(ValueError, match=r"checkpoint.every_n_steps=0 would save nothing"):
        check_config(compose_gpt("checkpoint.dir=ckpts"))
