"""``compile=True``: each layer's forward through ``torch.compile`` (inductor, on CPU here) after the split, under
ZeRO-1 with activation checkpointing, ZeRO-3 (FSDP2), and in the slow tier tp and pp: the same training as one
eager process within 1e-4 relative (seen: 1.8e-7), with graphs actually compiled."""

from __future__ import annotations

import pytest
from conftest import Batch
from parity import assert_same_params

CASES = [{"name": "plain", "steps": 10}, {"name": "accumulate", "steps": 10, "accumulate": 2, "clip": 0.05}]
BAR = 1e-4
LAYOUTS = {  # label: (world, strategy, dp, tp)
    "zero1-ac-full": (2, "hybrid3d:dp=2,zero_stage=1,compile=1,activation_checkpointing=full", 2, 1),
    "zero3": (2, "zero3:compile=1", 2, 1),
}
SLOW_LAYOUTS = {
    "dp2-tp2": (4, "hybrid3d:dp=2,tp=2,compile=1", 2, 2),
    "pp2": (2, "hybrid3d:pp=2,compile=1", 1, 1),
    "zero3-selective": (2, "hybrid3d:dp=2,zero_stage=3,compile=1,activation_checkpointing=selective", 2, 1),
}


def _check(run, reference, label: str, dp: int, tp: int) -> None:
    for case in CASES:
        name = case["name"]
        got, want = run.losses(name, [d * tp for d in range(dp)]), reference.losses(name)
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
        print(f"{label} {name}: max loss rel diff {worst:.1e}, graphs {run.case(name)['compiled_graphs']}")
        assert worst <= BAR, f"{label} {name}: {got} vs {want}"
        assert run.case(name)["compiled_graphs"] > 0, f"{label}: nothing was compiled"
        assert_same_params(run.params(name), reference.params(name), label)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    spec = {label: (world, strategy, CASES) for label, (world, strategy, _, _) in LAYOUTS.items()}
    return Batch(tmp_path_factory, {**spec, "reference": (1, "auto", CASES)}, tag="compile")


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_compiled_layers_train_like_one_eager_process(runs, label):
    _, _, dp, tp = LAYOUTS[label]
    _check(runs[label], runs["reference"], label, dp, tp)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW_LAYOUTS))
def test_compiled_layers_under_tp_and_pp(tmp_path_factory, label):
    world, strategy, dp, tp = SLOW_LAYOUTS[label]
    runs = Batch(tmp_path_factory, {label: (world, strategy, CASES), "reference": (1, "auto", CASES)}, tag=label)
    _check(runs[label], runs["reference"], label, dp, tp)


# ----- the measurement callbacks leave compilation alone (this process, Lightning's own strategy) -----
def _fit_compiled_tiny_gpt(callbacks: list) -> int:
    """Four steps of a tiny GPTModule with its layers compiled (as ``compile=True`` compiles them); the graphs made."""
    import lightning.pytorch as pl
    import torch
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    from lightning_parallel.models import GPTModule
    from lightning_parallel.models.gpt import GPTConfig
    from lightning_parallel.models.synthetic import SyntheticTokens
    from lightning_parallel.parallel.parallelize import compile_layers

    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(0, verbose=False)
    model = GPTModule(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32))
    assert compile_layers(model)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=True,  # Lightning's summary runs example_input_array under its FLOP counter
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(SyntheticTokens(num_samples=32, seq_len=16, vocab_size=64), batch_size=8))
    return int(counters["stats"]["unique_graphs"])


def test_measured_first_batches_do_not_keep_compiled_layers_eager():
    """torch.compile marks a function met first under a dispatch mode as skipped for good. Lightning's model
    summary (at fit start) and our callbacks (the first batches) run the model under such modes: the compiled
    layers run eagerly there and compile outside them."""
    from lightning_parallel.callbacks.activation import ActivationMemoryMonitor
    from lightning_parallel.callbacks.monitor import TrainingMonitor

    graphs = _fit_compiled_tiny_gpt([TrainingMonitor(measure_step=0), ActivationMemoryMonitor(batch=1)])
    assert graphs > 0, "the layers stayed eager after the measured batches"


def test_a_dispatch_mode_at_the_first_call_keeps_torch_compile_eager():
    """Why compile_layers routes calls under a dispatch mode to the eager forward (a canary: if torch starts
    compiling the plain case, the routing can go)."""
    import torch
    from torch._dynamo.utils import counters

    from lightning_parallel.parallel.measure.memory import ActivationMemory
    from lightning_parallel.parallel.parallelize import _compiled_outside_dispatch_modes

    layer = torch.nn.Linear(8, 8)
    for routed, want_graphs in ((False, 0), (True, 1)):
        torch._dynamo.reset()
        counters.clear()
        forward = lambda x: torch.relu(layer(x))  # noqa: E731
        compiled = _compiled_outside_dispatch_modes(forward) if routed else torch.compile(forward)
        with ActivationMemory(exclude=layer):
            compiled(torch.randn(2, 8))
        compiled(torch.randn(2, 8))
        assert int(counters["stats"]["unique_graphs"]) == want_graphs, routed
