"""Hugging Face families as registered entries (lightning_parallel/hf/families/): a model_type with no entry is
refused by name before anything is built, one registered as Llama's is (described_family) gets the same layers and
plan, and an entry's fields (masks, cp, experts) decide what it refuses."""

from __future__ import annotations

import pytest
import torch
import transformers

from lightning_parallel.hf import (
    HFCausalLM,
    HFFamily,
    check_hf_degrees,
    described_family,
    hf_pipeline_layers,
    hf_tensor_parallel_plan,
    register_hf_family,
)
from lightning_parallel.hf.families import HF_FAMILIES, hf_expert_plan
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.parallel.tensor.plan import check_tp_plan

COMMON = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip


def build(model_type: str, **extra):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **extra)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def assert_layers_compute_forward(model) -> None:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, x = model(input_ids=ids).logits, ids
        for layer in hf_pipeline_layers(model):
            x = layer(x)
    torch.testing.assert_close(x, want, rtol=0, atol=1e-6)


@pytest.fixture
def restore_registry():
    saved = dict(HF_FAMILIES)
    yield
    HF_FAMILIES.clear()
    HF_FAMILIES.update(saved)


def test_an_unregistered_family_is_refused_by_name_with_the_way_to_register_it():
    config = transformers.AutoConfig.for_model("arcee", **COMMON)
    with pytest.raises(ValueError, match=r"model_type 'arcee' is not a registered family: this package splits .*llama"):
        HFCausalLM(config)
    with pytest.raises(ValueError, match=r"register_hf_family\(described_family\('arcee'\)\)"):
        hf_tensor_parallel_plan(build("arcee"))


def test_a_family_registered_as_llama_is_gets_its_layers_and_plan(restore_registry):
    register_hf_family(described_family("arcee"))
    model = build("arcee")
    assert_layers_compute_forward(model)
    check_tp_plan(model, hf_tensor_parallel_plan(model, sequence_parallel=True), tp=2)
    check_hf_degrees(model, ParallelDims.of(pp=2, tp=2))
    assert HFCausalLM(model.config).family.model_type == "arcee"


def test_registration_is_checked():
    with pytest.raises(ValueError, match=r"'llama' is registered already: pass replace=True"):
        register_hf_family(described_family("llama"))
    with pytest.raises(TypeError, match=r"register_hf_family takes an HFFamily, not dict"):
        register_hf_family({"model_type": "x"})


def test_the_entry_decides_what_is_refused(restore_registry):
    """Masks a stage cannot rebuild under pp, and cp, are refused by the entry's fields, naming them."""
    mistral = build("mistral", sliding_window=4)
    check_hf_degrees(mistral, ParallelDims.of(pp=2, cp=1))
    register_hf_family(described_family("mistral", masks={"full_attention": "create_causal_mask"}), replace=True)
    with pytest.raises(
        ValueError, match=r"pp=2 cannot rebuild the attention mask of \['sliding_attention'\].*HFFamily"
    ):
        check_hf_degrees(mistral, ParallelDims.of(pp=2))
    register_hf_family(
        HFFamily("llama", HF_FAMILIES["llama"].tp_plan, HF_FAMILIES["llama"].layers, context=False), replace=True
    )
    with pytest.raises(ValueError, match=r"cp=2: the llama family's attention does not take context parallelism"):
        check_hf_degrees(build("llama"), ParallelDims.of(cp=2))


def test_qwen2_moe_entry_splits_experts_and_computes_the_forward():
    model = build("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=32)  # fmt: skip
    assert_layers_compute_forward(model)
    check_tp_plan(model, hf_tensor_parallel_plan(model), tp=2)
    assert list(hf_expert_plan(model)) == ["model.layers.*.mlp.experts"]
    check_hf_degrees(model, ParallelDims.of(pp=2, ep=2))
