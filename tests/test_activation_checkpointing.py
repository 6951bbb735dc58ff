"""Activation checkpointing: the same training with less activation memory and unchanged names; under the
strategies, the same numbers as one process without it."""

from __future__ import annotations

import copy
import io

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import PARITY_CASES, Batch
from parity import assert_same_losses, assert_same_params
from test_hybrid3d_parity import Layout, check_against_reference
from torch import nn
from torch.utils.data import DataLoader

from lightning_parallel import ActivationCheckpointing, ActivationMemoryMonitor, Hybrid3DStrategy, ZeroStrategy
from lightning_parallel.models import GPTConfig, GPTModule, SyntheticTokens
from lightning_parallel.models.gpt import RecipeGPT
from lightning_parallel.models.vgg import VGG, VGGConfig
from lightning_parallel.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpoint_layers,
    checkpointing_mode,
)
from lightning_parallel.parallel.measure.memory import measure_saved_activation_bytes
from lightning_parallel.parallel.pipeline.split import ElsewhereLayer
from lightning_parallel.recipes.common import build_strategy
from lightning_parallel.recipes.strategy_conf import strategy_conf

MODES = ["none", "full", "selective"]


def build(kind: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny GPT (with dropout for 'gpt_dropout') or VGG with BatchNorm, and a batch for it."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind.startswith("gpt"):
        dropout = 0.1 if kind == "gpt_dropout" else 0.0
        model = RecipeGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=8, d_model=32, dropout=dropout))
        return model, (torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
    model = VGG(VGGConfig(name="vgg11", width=8))
    return model, (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g))


def train(kind: str, mode: str, steps: int = 2) -> dict:
    """A few SGD steps; per step the loss, the gradients and the activation bytes the forward left for backward."""
    model, (x, y) = build(kind)
    apply_activation_checkpointing(model.layers(), mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)  # dropout's masks

    def loss_fn() -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    out: dict = {"losses": [], "grads": [], "bytes": []}
    for _ in range(steps):
        loss, nbytes = measure_saved_activation_bytes(loss_fn, exclude=model)
        loss.backward()
        out["losses"].append(loss.detach())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["bytes"].append(nbytes)
        optimizer.step()
        optimizer.zero_grad()
    out["state"] = {k: v.clone() for k, v in model.state_dict().items()}  # BatchNorm statistics included
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return {(kind, mode): train(kind, mode) for kind in ("gpt", "gpt_dropout", "vgg") for mode in MODES}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("kind", ["gpt", "gpt_dropout", "vgg"])
def test_same_losses_gradients_and_statistics(kind, mode, runs):
    """Recomputation reproduces the forward: dropout masks, and BatchNorm statistics updated once per step."""
    got, want = runs[(kind, mode)], runs[(kind, "none")]
    worst = 0.0
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(g - w).item() <= 1e-7, f"{kind} {mode} step {step}: loss {g.item()} != {w.item()}"
        for name, grad in want["grads"][step].items():
            diff = (got["grads"][step][name] - grad).abs().max().item()
            assert diff <= 1e-7, f"{kind} {mode} step {step}: {name}.grad differs by {diff:.1e}"
            worst = max(worst, diff)
    for name, value in want["state"].items():
        assert torch.equal(got["state"][name], value), f"{kind} {mode}: {name} differs after training"
    print(f"{kind} {mode}: largest gradient difference {worst:.1e}")


@pytest.mark.parametrize("kind", ["gpt", "vgg"])
def test_saved_activation_bytes_none_selective_full(kind, runs):
    none, selective, full = (runs[(kind, mode)]["bytes"][-1] for mode in ("none", "selective", "full"))
    print(f"{kind}: saved activation bytes none {none}, selective {selective}, full {full}")
    assert none > selective > full > 0


def test_names_state_dict_and_copies_unchanged():
    model, (x, _) = build("gpt")
    plain = copy.deepcopy(model)
    apply_activation_checkpointing(model.layers(), "selective")
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(plain.state_dict(), strict=True)
    assert all(checkpointing_mode(layer) == "selective" for layer in model.layers())
    # a copy checkpoints itself, with its own weights
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.blocks[0].mlp.fc.weight.add_(1.0)
    assert twin.blocks[0].forward.module is twin.blocks[0]
    assert not torch.equal(twin(x), model(x))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert checkpointing_mode(loaded.blocks[1]) == "selective" and torch.equal(loaded(x), model(x))


def test_which_layers():
    lit = GPTModule(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=8, d_model=32))
    assert checkpoint_layers(lit) == lit.model.layers()  # pipeline_layers()
    assert checkpoint_layers(lit.model) == list(lit.model.blocks)  # no protocol: the repeated blocks
    vgg, _ = build("vgg")
    assert checkpoint_layers(vgg) == list(vgg.features)
    layers = [ElsewhereLayer("model.embed", 0), *lit.model.layers()[1:]]
    assert checkpoint_layers(layers) == lit.model.layers()[1:]  # another pipeline stage's layers left out


def test_applying_twice():
    model, _ = build("gpt")
    assert apply_activation_checkpointing(model, "none") == []
    apply_activation_checkpointing(model, "full")
    apply_activation_checkpointing(model, "full")  # a model fitted again: unchanged
    with pytest.raises(ValueError, match=r"already checkpointed with mode 'full', not 'selective'"):
        apply_activation_checkpointing(model, "selective")


@pytest.mark.parametrize(
    "make",
    [
        lambda: Hybrid3DStrategy(activation_checkpointing="partial"),
        lambda: ZeroStrategy(stage=3, activation_checkpointing="partial"),
        lambda: apply_activation_checkpointing(nn.Linear(2, 2), "partial"),
    ],
)
def test_unknown_mode(make):
    with pytest.raises(ValueError, match=r"activation_checkpointing='partial' is unknown: set it to one of none, full"):
        make()


def fit_tiny_gpt(mode: str) -> tuple[list[float], int | None, GPTModule]:
    """Three steps in this process under Lightning's own "auto" strategy, with the callbacks."""
    pl.seed_everything(0, verbose=False)
    model = GPTModule(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=8, d_model=32))
    losses: list[float] = []
    model.on_train_batch_end = lambda outputs, *_: losses.append(float(outputs["loss"]))
    monitor = ActivationMemoryMonitor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor, ActivationCheckpointing(mode)],
    )
    data = SyntheticTokens(num_samples=24, seq_len=16, vocab_size=64)
    trainer.fit(model, DataLoader(data, batch_size=8))
    return losses, monitor.bytes, model


def test_callbacks_under_lightnings_own_strategy():
    plain, plain_bytes, _ = fit_tiny_gpt("none")
    losses, nbytes, model = fit_tiny_gpt("full")
    assert all(checkpointing_mode(layer) == "full" for layer in model.model.layers())
    assert losses == plain and len(losses) == 3
    print(f"auto strategy: activation bytes none {plain_bytes}, full {nbytes}")
    assert plain_bytes > nbytes > 0


def test_recipe_key():
    conf = strategy_conf("zero3", activation_checkpointing="selective")
    assert build_strategy(conf).config.activation_checkpointing == "selective"
    assert Hybrid3DStrategy(activation_checkpointing=None).config.activation_checkpointing == "none"
    conf.activation_checkpointing = "all"
    with pytest.raises(ValueError, match=r"strategy.activation_checkpointing='all' is unknown"):
        build_strategy(conf)


# ----- distributed: the strategies with activation checkpointing against one process without it -----

AC_CASES = [{**PARITY_CASES[0], "activation_memory": 1}, PARITY_CASES[2]]  # plain (+ validation), accumulation


HYBRID = {
    "w2-pp2-1f1b-full": (Layout(2, 2, 1, 1, schedule="1f1b", microbatches=2), "full"),
    "w4-pp2-tp2-1f1b-full": (Layout(4, 2, 1, 2, schedule="1f1b", microbatches=2), "full"),
    "w4-dp2-tp2-zero3-sp-selective": (Layout(4, 1, 2, 2, zero=3, sp=True), "selective"),
}


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory) -> Batch:
    runs = {"zero3-full": (2, "zero3:activation_checkpointing=full", AC_CASES)}
    for name, (layout, mode) in HYBRID.items():
        runs[name] = (layout.world, f"{layout.spec},activation_checkpointing={mode}", AC_CASES)
    return Batch(tmp_path_factory, runs, tag="ac")


def test_zero3_full(reference, dist_runs):
    run = dist_runs["zero3-full"]
    for case in AC_CASES:
        label = f"zero3 full {case['name']}"
        loss_rel = assert_same_losses(run.losses(case["name"]), reference.losses(case["name"]), label)
        param_abs = assert_same_params(run.params(case["name"]), reference.params(case["name"]), label)
        print(f"{label}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")
    want_val = reference.case("plain")["val_loss"]
    for rank in range(2):
        assert abs(run.case("plain", rank)["val_loss"] - want_val) <= 1e-5 * want_val
    print("zero3 full activation bytes per rank:", [run.case("plain", r)["activation_bytes"] for r in range(2)])


@pytest.mark.parametrize(
    "name", [pytest.param(k, marks=pytest.mark.slow) if v[0].world > 2 else k for k, v in HYBRID.items()]
)
def test_hybrid3d(name, reference, dist_runs):
    layout, mode = HYBRID[name]
    run = dist_runs[name]
    check_against_reference(run, reference, layout, AC_CASES)
    per_rank = [run.case("plain", r)["activation_bytes"] for r in range(layout.world)]
    print(f"{layout.id} {mode} activation bytes per rank: {per_rank}")
    assert all(b > 0 for b in per_rank)
