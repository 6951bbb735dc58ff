"""The GPT recipe's optimizer group (conf/optimizer/, lightning_parallel/recipes/optimizers.py): each option composes
and builds its optimizer, adamw is the model's own optimizer as before, bad input is refused before launch."""

from __future__ import annotations

import pytest
import torch
from test_recipe_configs import compose_gpt

from lightning_parallel.models import GPTConfig, GPTModule
from lightning_parallel.parallel.optim.muon import MuonAdamW
from lightning_parallel.recipes.gpt import check_config
from lightning_parallel.recipes.optimizers import build_optimizer, use_optimizer

TINY = ["model=gpt_tiny", "trainer.devices=1"]


def _model(**kwargs) -> GPTModule:
    torch.manual_seed(0)
    return GPTModule(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32), **kwargs)


def test_adamw_default_is_the_models_own_optimizer():
    cfg = compose_gpt(*TINY)
    assert cfg.optimizer.name == "adamw"
    model = _model(lr=cfg.model.lr, weight_decay=cfg.model.weight_decay)
    own = model.configure_optimizers()
    built = build_optimizer(cfg.optimizer, model)
    assert type(built) is type(own) is torch.optim.AdamW
    strip = [{k: v for k, v in g.items() if k != "params"} for g in own.param_groups]
    assert strip == [{k: v for k, v in g.items() if k != "params"} for g in built.param_groups]
    assert [len(g["params"]) for g in own.param_groups] == [len(g["params"]) for g in built.param_groups]


def test_overrides_reach_the_optimizer():
    sgd = build_optimizer(compose_gpt(*TINY, "optimizer=sgd", "optimizer.lr=0.5").optimizer, _model())
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["lr"] == 0.5
    cfg = compose_gpt(*TINY, "optimizer=muon", "optimizer.ns_dtype=float32", "optimizer.muon_lr=0.01")
    model = _model(warmup_steps=4)
    use_optimizer(model, cfg)
    made = model.configure_optimizers()
    muon = made["optimizer"]
    assert isinstance(muon, MuonAdamW) and made["lr_scheduler"]["interval"] == "step"
    assert [g["use_muon"] for g in muon.param_groups] == [True, False, False]
    assert muon.param_groups[0]["ns_dtype"] == "float32"
    # the warmup scales Muon's and AdamW's rates alike: lr / 4 at the first step
    assert [g["lr"] for g in muon.param_groups] == pytest.approx([0.01 / 4, cfg.model.lr / 4, cfg.model.lr / 4])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["optimizer.name=lion"], r"optimizer='lion' is not an optimizer of the recipes: pick one of adamw, sgd, muon"),
        (["optimizer=muon", "optimizer.ns_dtype=float16"], r"optimizer.ns_dtype='float16'.*bfloat16, float32"),
        (["optimizer=muon", "precision=16-mixed"], r"optimizer=muon with precision=16-mixed.*bf16-mixed"),
        (["optimizer=muon", "strategy=zero2_offload", "trainer.devices=2"], r"optimizer=muon with strategy=zero2_o"),
        (
            ["optimizer=muon", "strategy=hybrid3d", "strategy.zero_stage=2", "strategy.tp=2", "trainer.devices=2"],
            r"strategy=hybrid3d \(zero_stage=2, tp=2\).*strategy.zero_stage=3",
        ),
    ],
)
def test_bad_optimizer_settings_are_refused_before_launch(overrides, match):
    with pytest.raises(ValueError, match=match):
        check_config(compose_gpt(*TINY, *overrides))


@pytest.mark.parametrize("strategy", ["zero3", "zero1", "zero2", "ddp"])
def test_muon_passes_the_checks(strategy):
    check_config(compose_gpt("model=gpt_tiny", "optimizer=muon", f"strategy={strategy}", "trainer.devices=2"))
