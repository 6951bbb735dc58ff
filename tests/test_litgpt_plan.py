"""The LitGPT plan, layers and checks, without any process group: the fused q/k/v split keeps each rank's query
heads with their key/value group (the tensor-parallel attention computed rank by rank equals LitGPT's own), the
pipeline layers run as ``GPT.forward``, every bad input refused with the setting and the fix."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.litgpt import (
    LitGPTCausalLM,
    check_litgpt_degrees,
    litgpt_pipeline_layers,
    litgpt_tensor_parallel_plan,
)
from lightning_parallel.litgpt.module import LITGPT_CONFIG_KEY
from lightning_parallel.litgpt.plan import GroupedQKVColwise, LocalHeadsAttention, qkv_columns
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.parallel.tensor.plan import check_tp_plan
from lightning_parallel.strategies.checks import check_model

litgpt_config = pytest.importorskip("litgpt.config")  # make install installs the litgpt extra
from litgpt.model import GPT, CausalSelfAttention  # noqa: E402
from litgpt.utils import chunked_cross_entropy, save_config  # noqa: E402

SIZES = dict(block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=2, n_embd=32, n_head=4)


def llama(**overrides) -> GPT:
    """Llama's layout with grouped-query attention (4 query heads, 2 key/value groups)."""
    torch.manual_seed(0)
    config = dict(SIZES, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False)
    config.update(norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)
    config.update(overrides)
    return GPT(litgpt_config.Config(name="tiny-llama", **config))


def neox(**overrides) -> GPT:
    """Pythia's layout (parallel residual, biases, partial rotary), shrunk."""
    torch.manual_seed(0)
    return GPT(litgpt_config.Config.from_name("pythia-14m", **{**SIZES, "intermediate_size": 64, **overrides}))


def test_qkv_columns_give_each_rank_its_heads_and_groups():
    # q: 4 heads x 2, k and v: 2 groups x 2 -> 16 columns; rank 1 has q heads 2, 3 and group 1
    assert qkv_columns(4, 2, 2, tp=2, rank=1).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    every = torch.cat([qkv_columns(8, 2, 4, tp=2, rank=r) for r in range(2)])
    assert sorted(every.tolist()) == list(range((8 + 2 * 2) * 4))  # each column on exactly one rank


@pytest.mark.parametrize(("n_head", "groups", "tp"), [(4, 2, 2), (4, 4, 2), (8, 2, 2), (8, 4, 4), (4, 4, 4)])
def test_attention_split_rank_by_rank_is_litgpts_attention(n_head, groups, tp):
    """The tensor-parallel attention's math without a process group: each rank's q/k/v columns of the whole
    projection, its heads' rows of the output projection; the partial outputs sum to LitGPT's attention."""
    torch.manual_seed(0)
    sizes = dict(n_embd=32, n_head=n_head, n_query_groups=groups, block_size=16, n_layer=1, padded_vocab_size=8)
    config = litgpt_config.Config(bias=True, **sizes)
    whole = CausalSelfAttention(config, block_idx=0)
    rope = GPT(config)  # its rotary tables
    x = torch.randn(2, 16, 32)
    cos, sin = rope.cos[:16].unsqueeze(0), rope.sin[:16].unsqueeze(0)
    want = whole(x, cos, sin)
    got = whole.proj.bias.clone()
    for rank in range(tp):
        local = copy.deepcopy(whole)
        local.config = copy.copy(config)
        local.config.n_head, local.config.n_query_groups = n_head // tp, groups // tp
        columns = qkv_columns(n_head, groups, config.head_size, tp, rank)
        local.qkv.weight.data, local.qkv.bias.data = whole.qkv.weight[columns], whole.qkv.bias[columns]
        heads = slice(rank * config.head_size * n_head // tp, (rank + 1) * config.head_size * n_head // tp)
        local.proj.weight.data, local.proj.bias.data = whole.proj.weight[:, heads], torch.zeros(32)
        got = got + local(x, cos, sin)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("make", [llama, neox])
def test_plan_matches_the_model(make):
    model = make()
    for sp in (False, True):
        plan = litgpt_tensor_parallel_plan(model, sequence_parallel=sp)
        check_tp_plan(model, plan, tp=2)  # every entry names a module, tp divides what it splits
        assert isinstance(plan["transformer.wte"], RowwiseParallel)
        assert isinstance(plan["transformer.h.*.attn"], LocalHeadsAttention)
        assert isinstance(plan["transformer.h.*.attn.qkv"], GroupedQKVColwise)
        assert isinstance(plan["transformer.h.*.attn.proj"], RowwiseParallel)
        assert isinstance(plan["lm_head"], ColwiseParallel) and not plan["lm_head"].use_local_output
        assert isinstance(plan.get("transformer.h.*.norm_2"), SequenceParallel) == sp
        assert isinstance(plan.get("transformer.ln_f"), SequenceParallel) == sp
    mlp = [path for path in plan if path.startswith("transformer.h.*.mlp.")]
    assert mlp == (
        ["transformer.h.*.mlp.fc_1", "transformer.h.*.mlp.fc_2"] if make is llama else ["transformer.h.*.mlp.fc"]
    ) + ["transformer.h.*.mlp.proj"]


def test_module_plan_is_prefixed():
    plan = LitGPTCausalLM(llama()).tensor_parallel_plan()
    assert "model.transformer.h.*.attn.qkv" in plan and "model.lm_head" in plan


@pytest.mark.parametrize(
    "make",
    [llama, neox, lambda: llama(rope_local_base_freq=1000.0, rope_indices=[0, 1]), lambda: neox(n_query_groups=1)],
)
def test_pipeline_layers_compute_gpt_forward(make):
    model = make()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model(ids)
    x = ids
    for layer in litgpt_pipeline_layers(model):
        x = layer(x)
    assert torch.equal(x, want)
    assert len(litgpt_pipeline_layers(model)) == 2 + 3  # hooks installed once; wte, 2 blocks, ln_f, lm_head
    assert torch.equal(model(ids), want)  # GPT.forward unchanged by the hooks


def test_pipeline_layer_refuses_too_long_and_extra_inputs():
    layers = litgpt_pipeline_layers(llama(block_size=8))
    with pytest.raises(ValueError, match=r"sequence of length 9, max seq length is only 8"):
        layers[1](torch.zeros(1, 9, 32))
    with pytest.raises(TypeError, match=r"Under pp > 1 the model takes input_ids alone"):
        layers[0](torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4))


@pytest.mark.parametrize("make", [llama, neox])
def test_loss_is_litgpt_loss(make):
    module = LitGPTCausalLM(make())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 5:] = -100
    logits = module(ids)
    want = chunked_cross_entropy(logits[:, :-1], labels[:, 1:])  # litgpt's own, as its pretraining calls it
    assert torch.allclose(module.loss(logits, labels), want, rtol=0, atol=1e-6)
    assert torch.equal(module._step_loss((ids, labels)), module._step_loss({"input_ids": ids, "labels": labels}))
    with pytest.raises(ValueError, match=r"takes no attention_mask.*labels=-100"):
        module._step_loss({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    with pytest.raises(ValueError, match=r"takes no position_ids: packed batches .*data.packing=false"):
        module._step_loss({"input_ids": ids, "position_ids": torch.arange(16).expand(2, 16)})


def test_sources_and_optimizer_groups(tmp_path):
    model = llama()
    save_config(model.config, tmp_path)
    no_weights = LitGPTCausalLM(str(tmp_path), n_layer=1)  # overrides the folder's config
    assert (no_weights.model.config.n_query_groups, no_weights.model.config.n_layer) == (2, 1)
    torch.save(model.state_dict(), tmp_path / "lit_model.pth")
    from_folder = LitGPTCausalLM(tmp_path)
    assert torch.equal(from_folder.model.lm_head.weight, model.lm_head.weight)
    assert LitGPTCausalLM(model.config).model.config.n_query_groups == 2
    named = LitGPTCausalLM("pythia-14m", n_layer=1, n_embd=32, block_size=32)
    assert (named.model.config.n_layer, named.model.config.padded_vocab_size) == (1, 50304)
    assert LitGPTCausalLM(model).model is model
    groups = LitGPTCausalLM(model, weight_decay=0.05).configure_optimizers().param_groups
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    assert all(p.dim() < 2 for p in groups[1]["params"]) and groups[1]["params"]  # norm weights
    checkpoint: dict = {}
    from_folder.on_save_checkpoint(checkpoint)
    assert litgpt_config.Config(**checkpoint[LITGPT_CONFIG_KEY]) == model.config


@pytest.mark.parametrize(
    ("source", "kwargs", "error", "match"),
    [
        ("no-such-model", {}, ValueError, r"neither a local folder nor a litgpt config name.*'pythia-14m'"),
        (42, {}, TypeError, r"takes a litgpt GPT, a Config, a config name or a checkpoint folder, not int"),
        ("FOLDER", {}, ValueError, r"the folder has no model_config.yaml.*never downloads"),
        ("GPT", {"n_layer": 1}, ValueError, r"overrides \['n_layer'\] apply to a config name or folder, not to a GPT"),
    ],
)
def test_bad_sources(source, kwargs, error, match, tmp_path):
    source = {"FOLDER": tmp_path, "GPT": llama()}.get(source, source) if isinstance(source, str) else source
    with pytest.raises(error, match=match):
        LitGPTCausalLM(source, **kwargs)


@pytest.mark.parametrize(
    ("make", "pp", "tp", "match"),
    [
        (lambda: llama(n_head=2, n_query_groups=2), 1, 4, r"tp=4 does not divide the model's n_head=2: .*\[1, 2\]"),
        (lambda: llama(n_query_groups=1), 1, 2, r"tp=2 does not divide the model's n_query_groups=1"),
        (lambda: neox(padded_vocab_size=127), 1, 2, r"padded_vocab_size=127.*padding_multiple"),
        (llama, 3, 1, r"pp=3 is more pipeline stages than the model's 2 blocks \(n_layer\): use pp <= 2"),
        (lambda: llama(scale_embeddings=True), 2, 1, r"pp=2 cannot split .*config.scale_embeddings=True.*pp=1"),
        (lambda: llama(final_logit_softcapping=30.0), 2, 1, r"config.final_logit_softcapping=30.0.*use pp=1"),
        (lambda: llama(norm_qk=True, norm_qk_type="olmo2"), 1, 2, r"norm_qk_type='olmo2'.*use tp=1"),
    ],
)
def test_bad_degrees(make, pp, tp, match):
    with pytest.raises(ValueError, match=match):
        check_litgpt_degrees(make(), ParallelDims.of(pp=pp, tp=tp))


def test_supported_degrees_pass():
    check_litgpt_degrees(llama(scale_embeddings=True, final_logit_softcapping=30.0), ParallelDims.of(pp=1, tp=2))
    check_litgpt_degrees(neox(), ParallelDims.of(pp=2, tp=4))


def test_bad_degrees_refused_before_launch():
    """The strategy's pre-launch check (no process group) asks LitGPTCausalLM, which names the setting."""
    module = LitGPTCausalLM(llama(n_query_groups=1))
    strategy = Hybrid3DStrategy(tp=2)
    with pytest.raises(ValueError, match=r"tp=2 does not divide the model's n_query_groups=1"):
        check_model(module, strategy.config, strategy.config.dims(2))


def test_sequence_parallel_with_pipeline_refused_before_launch():
    module = LitGPTCausalLM(llama())
    strategy = Hybrid3DStrategy(pp=2, tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True with pp > 1 .*LitGPT.*set one of them off"):
        check_model(module, strategy.config, strategy.config.dims(4))


def test_unknown_mlp_refused():
    model = llama()
    model.config.mlp_class_name = "LLaMAMoE"
    with pytest.raises(ValueError, match=r"does not know the MLP LLaMAMoE.*tensor_parallel_plan\(\), or use tp=1"):
        litgpt_tensor_parallel_plan(model)
