"""HFCausalLM (Hugging Face Llama with grouped-query attention, and GPT-2) under zero3 and hybrid3d: the same
10 AdamW steps as the plain HF model trained in one process (its own forward and loss, no Lightning)."""

from __future__ import annotations

import pytest
import torch
import transformers  # a test dependency: make install installs the hf extra
from causal_lm_parity import CLIP, assert_clipping_active, check, launch, train_reference
from conftest import Batch

# tp 2 divides heads (4), key/value heads (2) and the vocabulary (128); 2 decoder layers: pp up to 2
SMALL = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
    # other families (tests/test_hf_families.py checks more of them in one process): sliding windows of 4 tokens
    # on 16-token rows, Phi-3's fused projections with gathered outputs, OLMo 2's norms over all heads
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=4),
    "phi3": lambda: transformers.Phi3Config(**SMALL, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "olmo2": lambda: transformers.Olmo2Config(**SMALL, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    ),
}

# label -> (world, strategy spec, model, tp); every run of one world size shares one launch. A label with
# "clip" clips the gradient norm at 0.05 (below the norms these steps have), with "accum" accumulates 2
# micro-batches per step, with "tuple" feeds (input_ids, labels) tuples.
FAST = {
    "llama zero3": (2, "zero3", "llama", 1),
    "llama zero1 clip": (2, "zero1", "llama", 1),
    "gpt2 zero2 accum": (2, "zero2", "gpt2", 1),
    "llama tp2 clip": (2, "hybrid3d:tp=2", "llama", 2),
    "llama tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "llama", 2),
    "llama pp2 1f1b": (2, "hybrid3d:pp=2", "llama", 1),
    "llama pp2 gpipe": (2, "hybrid3d:pp=2,pp_schedule=gpipe", "llama", 1),
    "llama pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "llama", 1),
    "gpt2 zero3": (2, "zero3", "gpt2", 1),
    "gpt2 tp2": (2, "hybrid3d:tp=2", "gpt2", 2),
    "gpt2 pp2 interleaved_1f1b": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", "gpt2", 1),
    "llama dp2 x tp2 zero3 accum": (4, "hybrid3d:tp=2,zero_stage=3", "llama", 2),
}
SLOW = {
    "llama pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "llama", 2),
    "gpt2 pp2 x tp2 clip": (4, "hybrid3d:pp=2,tp=2", "gpt2", 2),
    "gpt2 dp2 x tp2 zero3": (4, "hybrid3d:tp=2,zero_stage=3", "gpt2", 2),
    "gpt2 tp2 sp": (4, "hybrid3d:tp=2,dp=2,sequence_parallel=1", "gpt2", 2),
    "llama zero2 tuple": (4, "zero2", "llama", 1),
    "gpt2 pp2 gpipe": (2, "hybrid3d:pp=2,pp_schedule=gpipe", "gpt2", 1),
    "gpt2 pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "gpt2", 1),
    "llama pp2 interleaved_1f1b": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", "llama", 1),
    "qwen2 pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "qwen2", 2),
    "mistral pp2": (2, "hybrid3d:pp=2", "mistral", 1),
    "mistral tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "mistral", 2),
    "phi3 tp2": (2, "hybrid3d:tp=2", "phi3", 2),
    "phi3 pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "phi3", 2),
    "olmo2 tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "olmo2", 2),
}
# every (pp, dp, tp) split of world 8 the tiny Llama takes: tp 1 or 2 (2 key/value heads), pp 1 or 2 (2 layers);
# microbatches 2: a dp rank's share of the 8 samples can be 2
WORLD8 = {
    f"llama w8 pp{pp} dp{8 // pp // tp} tp{tp}": (
        8,
        f"hybrid3d:pp={pp},tp={tp},zero_stage=3" + (",microbatches=2" if pp > 1 else ""),
        "llama",
        tp,
    )
    for pp in (1, 2)
    for tp in (1, 2)
}


def save_folders(tmp_path_factory, configs: dict) -> dict[str, str]:
    """Each tiny model of ``configs`` (name -> config factory) written once by save_pretrained: the workers and the
    reference load the same weights."""
    out = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config())
        folder = tmp_path_factory.mktemp(f"hf_{name}")
        model.save_pretrained(folder)
        out[name] = str(folder)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return save_folders(tmp_path_factory, CONFIGS)


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, FAST, "hf", "hf")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, SLOW, "hf_slow", "hf")


@pytest.fixture(scope="module")
def world8_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, WORLD8, "hf_w8", "hf")


def plain_hf_training(folder: str, clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: HF's model, forward and loss (``labels=``), trained in this process."""
    from lightning_parallel.hf import HFCausalLM  # the defaults the workers train with

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    return train_reference(
        model, model.config.vocab_size, lambda m, ids: m(input_ids=ids, labels=ids).loss,
        HFCausalLM.__init__.__defaults__, clip,
    )  # fmt: skip


@pytest.fixture(scope="module")
def references(folders) -> dict[tuple[str, float | None], tuple[list[float], dict[str, torch.Tensor]]]:
    return {(name, clip): plain_hf_training(folder, clip) for name, folder in folders.items() for clip in (None, CLIP)}


@pytest.mark.parametrize("label", list(FAST))
def test_hf_parity(label, fast_runs, references):
    check(fast_runs, label, FAST[label], references)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_hf_parity_wider(label, slow_runs, references):
    check(slow_runs, label, SLOW[label], references)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(WORLD8))
def test_hf_parity_every_world8_split(label, world8_runs, references):
    check(world8_runs, label, WORLD8[label], references)


@pytest.mark.parametrize("model", list(CONFIGS))
def test_clipping_is_active_in_the_reference(model, references):
    assert_clipping_active(references, model)


@pytest.mark.parametrize(
    ("label", "most"),
    [
        pytest.param("llama pp2 x tp2", 0.45, marks=pytest.mark.slow),
        pytest.param("gpt2 pp2 x tp2 clip", 0.45, marks=pytest.mark.slow),
        ("llama zero3", 0.55),
    ],
)
def test_each_rank_reads_only_its_part_of_the_folder(label, most, request, folders):
    """Weights are read after the split: under pp2 x tp2 a rank reads its stages' tensor-parallel slices (the
    tiny models' stages are uneven: 3 and 2 layers of 5; GPT-2's fused q/k/v, a strided shard, is read whole),
    under ZeRO-3 its dp shard of each tensor (plus the small ones it holds whole)."""
    from safetensors.torch import load_file

    table, runs = (FAST, "fast_runs") if label in FAST else (SLOW, "slow_runs")
    world, _, model, _ = table[label]
    full = sum(t.numel() * t.element_size() for t in load_file(f"{folders[model]}/model.safetensors").values())
    read = [request.getfixturevalue(runs)[label].case("train", r)["bytes_read"] for r in range(world)]
    print(f"{label}: bytes read per rank {read} of {full} ({max(read) / full:.0%} at most)")
    assert all(0 < r <= most * full for r in read), (read, full)
