"""LitGPTCausalLM (a GPT-NeoX-style GPT, a Llama-style one with grouped-query attention, and a Qwen3-style one with
per-head q/k norms) under zero3 and hybrid3d: the same 10 AdamW steps as the plain LitGPT model trained in one
process (``GPT.forward`` and litgpt's own ``chunked_cross_entropy`` on shifted targets, no Lightning)."""

from __future__ import annotations

import pytest
import torch
from causal_lm_parity import CLIP, assert_clipping_active, check, launch, train_reference
from conftest import Batch

litgpt_config = pytest.importorskip("litgpt.config")  # make install installs the litgpt extra
from litgpt.model import GPT  # noqa: E402
from litgpt.utils import chunked_cross_entropy, save_config  # noqa: E402

SIZES = dict(block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=2, n_embd=32, n_head=4)

LLAMA_LIKE = dict(
    n_query_groups=2,
    rotary_percentage=1.0,
    parallel_residual=False,
    bias=False,
    norm_class_name="RMSNorm",
    mlp_class_name="LLaMAMLP",
    intermediate_size=64,
    **SIZES,
)

# tp 2 divides heads (4), key/value groups (4 or 2) and the vocabulary (128); 2 blocks: pp up to 2
CONFIGS = {
    # pythia's layout (parallel residual, LayerNorm, biases, rotary on a quarter of each head), shrunk
    "neox": lambda: litgpt_config.Config.from_name("pythia-14m", intermediate_size=64, **SIZES),
    "llama": lambda: litgpt_config.Config(name="tiny-llama", **LLAMA_LIKE),
    # Qwen3's per-head q/k norms (norm_qk): replicated over tp, their gradients partial over each rank's heads
    "qwen3": lambda: litgpt_config.Config(name="tiny-qwen3", norm_qk=True, **LLAMA_LIKE),
}

# label -> (world, strategy spec, model, tp); every run of one world size shares one launch. A label with
# "clip" clips the gradient norm at 0.05 (below the norms these steps have), with "accum" accumulates 2
# micro-batches per step, with "tuple" feeds (input_ids, labels) tuples.
FAST = {
    "llama zero1 clip": (2, "zero1", "llama", 1),
    "llama zero3": (2, "zero3", "llama", 1),
    "llama tp2 clip": (2, "hybrid3d:tp=2", "llama", 2),
    "llama tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "llama", 2),
    "llama pp2": (2, "hybrid3d:pp=2", "llama", 1),
    "neox pp2 interleaved_1f1b": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", "neox", 1),
    "qwen3 tp2 sp clip": (2, "hybrid3d:tp=2,sequence_parallel=1", "qwen3", 2),
}
SLOW = {
    "llama pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "llama", 2),
    "llama dp2 x tp2 zero3 accum": (4, "hybrid3d:tp=2,zero_stage=3", "llama", 2),
    "neox zero2 accum tuple": (4, "zero2", "neox", 1),
    "llama pp2 gpipe": (2, "hybrid3d:pp=2,pp_schedule=gpipe", "llama", 1),
    "llama pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "llama", 1),
    "neox zero3": (2, "zero3", "neox", 1),
    "neox tp2": (2, "hybrid3d:tp=2", "neox", 2),
    "neox tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "neox", 2),
    "neox pp2": (2, "hybrid3d:pp=2", "neox", 1),
    "neox dp2 x tp2 zero3": (4, "hybrid3d:tp=2,zero_stage=3", "neox", 2),
    "neox pp2 x tp2 clip": (4, "hybrid3d:pp=2,tp=2", "neox", 2),
    "qwen3 tp2": (2, "hybrid3d:tp=2", "qwen3", 2),
    "qwen3 dp2 x tp2 zero3": (4, "hybrid3d:tp=2,zero_stage=3", "qwen3", 2),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Each tiny model written once as litgpt writes a checkpoint folder (model_config.yaml, lit_model.pth): the
    workers and the reference load the same weights."""
    out = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = GPT(config())
        model.apply(model._init_weights)  # litgpt's own initialization (std 0.02)
        folder = tmp_path_factory.mktemp(f"litgpt_{name}")
        save_config(model.config, folder)
        torch.save(model.state_dict(), folder / "lit_model.pth")
        out[name] = str(folder)
    return out


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, FAST, "litgpt", "litgpt")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, SLOW, "litgpt_slow", "litgpt")


def plain_litgpt_training(folder: str, clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: LitGPT's GPT and loss (``chunked_cross_entropy`` of logits[:, :-1] against tokens[:, 1:], as
    litgpt's pretraining computes it), trained in this process."""
    from lightning_parallel.litgpt import LitGPTCausalLM  # the defaults the workers train with

    model = GPT(litgpt_config.Config.from_file(f"{folder}/model_config.yaml"))
    model.load_state_dict(torch.load(f"{folder}/lit_model.pth", weights_only=True))
    return train_reference(
        model, model.config.vocab_size, lambda m, ids: chunked_cross_entropy(m(ids)[:, :-1], ids[:, 1:], chunk_size=0),
        LitGPTCausalLM.__init__.__defaults__, clip,
    )  # fmt: skip


@pytest.fixture(scope="module")
def references(folders) -> dict[tuple[str, float | None], tuple[list[float], dict[str, torch.Tensor]]]:
    return {
        (name, clip): plain_litgpt_training(folder, clip) for name, folder in folders.items() for clip in (None, CLIP)
    }


@pytest.mark.parametrize("label", list(FAST))
def test_litgpt_parity(label, fast_runs, references):
    check(fast_runs, label, FAST[label], references)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_litgpt_parity_wider(label, slow_runs, references):
    check(slow_runs, label, SLOW[label], references)


@pytest.mark.parametrize("model", list(CONFIGS))
def test_clipping_is_active_in_the_reference(model, references):
    assert_clipping_active(references, model)
