"""Decoder-only families other than Llama and GPT-2 whose transformers config carries both plans: their
pipeline layers compute HF's own forward exactly (sliding-window layers, per-type rotary tables and the forward
extras included), their tensor-parallel plan resolves at tp=2, and what a stage cannot rebuild is refused by name
before any process starts. (Distributed parity for Qwen2 and Mistral with sliding windows: tests/test_hf_parity.py,
Qwen3, Gemma 2/3, Cohere and Granite: tests/test_hf_tp_extras.py.)"""

from __future__ import annotations

import pytest
import torch
import transformers  # a test dependency: make install installs the hf extra

from lightning_parallel.hf import check_hf_degrees, hf_pipeline_layers, hf_tensor_parallel_plan
from lightning_parallel.hf.families import FORWARD_EXTRAS, hf_family
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.parallel.tensor.plan import check_tp_plan
from lightning_parallel.parallel.tensor.styles import ReplicatedWithPartialGrad

COMMON = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip
# sliding windows of 4 tokens on 16-token inputs: a wrong mask at a stage start changes the logits
WORKS = {
    "qwen2 (a sliding layer)": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "mistral (sliding window)": ("mistral", {"sliding_window": 4}),
    "gemma": ("gemma", {"head_dim": 8}),
    # the forward extras at sizes that change the logits by more than the tolerance (test_forward_extras_matter)
    "gemma2 (logit softcap)": ("gemma2", {"head_dim": 8, "sliding_window": 4, "final_logit_softcapping": 0.5}),
    "granite": (
        "granite",
        {"residual_multiplier": 0.5, "attention_multiplier": 0.3, "embedding_multiplier": 2.0, "logits_scaling": 3.0},
    ),
    "cohere (logit_scale)": ("cohere", {"logit_scale": 0.5}),
    "cohere2 (logit_scale, sliding window)": ("cohere2", {"logit_scale": 0.5, "sliding_window": 4}),
    "starcoder2": ("starcoder2", {}),
    "olmo": ("olmo", {}),
    "helium": ("helium", {"head_dim": 8}),
    "phi3 (fused q/k/v, gathered)": ("phi3", {}),
    "olmo2 (q/k norms over all heads)": ("olmo2", {}),
    # q/k norms per head: "replicated_with_grad_allreduce"
    "gemma3 (logit softcap)": ("gemma3_text", {"head_dim": 8, "sliding_window": 4, "final_logit_softcapping": 0.5}),
    "qwen3": ("qwen3", {"head_dim": 8}),
}


def build(model_type: str, extra: dict):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **extra)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def assert_pipeline_layers_compute_forward(model) -> None:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        x = ids
        for layer in hf_pipeline_layers(model):
            x = layer(x)
    torch.testing.assert_close(x, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("label", list(WORKS))
def test_family_pipeline_layers_and_plan(label):
    model = build(*WORKS[label])
    assert_pipeline_layers_compute_forward(model)
    check_tp_plan(model, hf_tensor_parallel_plan(model, sequence_parallel=True), tp=2)
    check_hf_degrees(model, ParallelDims.of(pp=2, tp=2))


def test_qk_norms_per_head_are_replicated_with_partial_gradients():
    plan = hf_tensor_parallel_plan(build(*WORKS["qwen3"]), sequence_parallel=True)
    for norm in ("q_norm", "k_norm"):
        assert isinstance(plan[f"model.layers.*.self_attn.{norm}"], ReplicatedWithPartialGrad)


def test_a_sliding_window_matters_here():
    """The sliding-window cases test the mask: the same weights without the window give other logits."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    windowed, full = build("mistral", {"sliding_window": 4}), build("mistral", {"sliding_window": None})
    full.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        assert (windowed(input_ids=ids).logits - full(input_ids=ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("label", [label for label in WORKS if hf_family(WORKS[label][0]).extras])
def test_forward_extras_matter(label):
    """The extras at these sizes change the logits: pipeline layers without them would not match HF's forward."""
    model_type, extra = WORKS[label]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    neutral = {name: value for name, value in FORWARD_EXTRAS.items() if name in extra}
    with_extras, without = build(model_type, extra), build(model_type, {**extra, **neutral})
    with torch.no_grad():
        assert (with_extras(input_ids=ids).logits - without(input_ids=ids).logits).abs().max() > 1e-3


def test_forward_extras_of_other_families_are_refused_under_pp():
    """VaultGemma softcaps its logits too, but its forward was not read here: refused by name under pp."""
    model = build("vaultgemma", {"head_dim": 8})
    check_hf_degrees(model, ParallelDims.of(pp=1, tp=2))  # HF's own forward under tp: accepted
    with pytest.raises(ValueError, match=r"pp=2 cannot split a vaultgemma model whose config.final_logit_softcapping"):
        check_hf_degrees(model, ParallelDims.of(pp=2, tp=1))


def test_a_config_without_a_pipeline_plan_is_named():
    with pytest.raises(ValueError, match=r"base_model_pp_plan of StableLmConfig lists \[\]"):
        hf_pipeline_layers(build("stablelm", {}))
