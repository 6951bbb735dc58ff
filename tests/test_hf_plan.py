"""The Hugging Face plans and checks, without any process group: HF's style names translated to torch styles
(both v5 names of the gathered head), the pipeline layers running as HF's own forward, every bad input refused
with the setting and the fix."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import transformers  # a test dependency: make install installs the hf extra
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.hf import HFCausalLM, check_hf_degrees, hf_pipeline_layers, hf_tensor_parallel_plan
from lightning_parallel.hf.plan import translate_tp_plan
from lightning_parallel.hf.styles import Conv1DColwise, Conv1DRowwise
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.parallel.tensor.plan import check_tp_plan
from lightning_parallel.parallel.tensor.styles import HiddenStatesInput
from lightning_parallel.strategies.checks import check_model


def llama(**overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config.update(num_key_value_heads=2, max_position_embeddings=64)
    config.update(overrides)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config))


def gpt2(**overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0)
    config.update(attn_pdrop=0.0)
    config.update(overrides)
    return transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(**config))


@pytest.mark.parametrize("head_style", ["colwise_rep", "colwise_gather_output"])
def test_translation_of_both_head_names(head_style):
    base = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    plan = translate_tp_plan(base, {"lm_head": head_style}, "model.", sequence_parallel=False)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], RowwiseParallel)
    head = plan["lm_head"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Shard(-1),) and not head.use_local_output


def test_translation_sequence_parallel_and_gathered_inner_layer():
    plan = translate_tp_plan({"a.b": "rowwise", "a.c": "colwise_gather_output"}, {}, "m.", sequence_parallel=True)
    assert plan["m.a.b"].output_layouts == (Shard(1),)
    assert plan["m.a.c"].output_layouts == (Replicate(),)  # not the head: gathered as HF asks


def test_unknown_style_is_refused():
    with pytest.raises(
        ValueError, match=r"style 'packed_colwise' for 'model.x'.*tensor_parallel_plan\(\), or use tp=1"
    ):
        translate_tp_plan({"x": "packed_colwise"}, {}, "model.", sequence_parallel=False)


def test_llama_plan_matches_the_model():
    model = llama()
    for sp in (False, True):
        plan = hf_tensor_parallel_plan(model, sequence_parallel=sp)
        check_tp_plan(model, plan, tp=2)  # every entry names a module, tp divides what it splits
        assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
        assert isinstance(plan["model.layers.*.self_attn"], HiddenStatesInput)
        assert isinstance(plan.get("model.layers.*.input_layernorm"), SequenceParallel) == sp


def test_gpt2_plan_matches_the_model():
    model = gpt2()
    plan = hf_tensor_parallel_plan(model, sequence_parallel=True)
    check_tp_plan(model, plan, tp=2)
    assert (
        isinstance(plan["transformer.h.*.attn.c_attn"], Conv1DColwise)
        and plan["transformer.h.*.attn.c_attn"].parts == 3
    )
    assert isinstance(plan["transformer.h.*.mlp.c_proj"], Conv1DRowwise)
    assert isinstance(plan["transformer.ln_f"], SequenceParallel)


@pytest.mark.parametrize("make", [llama, gpt2])
def test_pipeline_layers_compute_hf_forward(make):
    model = make()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids).logits
    x = ids
    for layer in hf_pipeline_layers(model):
        x = layer(x)
    assert torch.equal(x, want)
    assert len(hf_pipeline_layers(model)) == len(hf_pipeline_layers(model))  # hooks installed once
    assert torch.equal(model(input_ids=ids).logits, want)  # HF's own forward unchanged by the hooks


@pytest.mark.parametrize("make", [llama, gpt2])
def test_loss_is_hf_loss(make):
    module = HFCausalLM(make())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 5:] = -100
    want = module.model(input_ids=ids, labels=labels).loss
    assert torch.allclose(module.loss(module(ids), labels), want, rtol=0, atol=1e-6)


def test_sources_and_optimizer_groups(tmp_path):
    model = llama()
    model.save_pretrained(tmp_path)
    from_folder = HFCausalLM(str(tmp_path))
    assert from_folder.model.lm_head.weight.is_meta  # read once the strategy split the model
    with pytest.raises(RuntimeError, match=r"not read yet: .* call .materialize\(\) first"):
        from_folder(torch.zeros(1, 4, dtype=torch.long))
    from_folder.materialize()
    assert torch.equal(from_folder.model.lm_head.weight, model.lm_head.weight)
    assert from_folder.weight_bytes_read == sum(p.numel() * p.element_size() for p in model.parameters())
    eager = HFCausalLM(str(tmp_path), lazy_load=False)
    assert torch.equal(eager.model.lm_head.weight, model.lm_head.weight) and eager.weight_bytes_read == 0
    assert HFCausalLM(model.config).model.config.num_key_value_heads == 2
    groups = HFCausalLM(model, weight_decay=0.05).configure_optimizers().param_groups
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    assert all(p.dim() < 2 for p in groups[1]["params"]) and groups[1]["params"]  # norm weights


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        ("/no/such/folder", ValueError, r"no such folder.*never downloads"),
        (42, TypeError, r"takes a PreTrainedModel, a local folder or a PretrainedConfig, not int"),
    ],
)
def test_bad_sources(source, error, match):
    with pytest.raises(error, match=match):
        HFCausalLM(source)


@pytest.mark.parametrize(
    ("make", "pp", "tp", "match"),
    [
        (
            lambda: llama(num_attention_heads=2, num_key_value_heads=2),
            1,
            4,
            r"tp=4 does not divide .*num_attention_heads=2",
        ),
        (lambda: llama(num_key_value_heads=1), 1, 2, r"tp=2 does not divide the model's num_key_value_heads=1"),
        (lambda: llama(vocab_size=127), 1, 2, r"vocab_size=127.*resize_token_embeddings"),
        (lambda: gpt2(n_head=2, n_embd=32), 1, 4, r"tp=4 does not divide the model's num_attention_heads=2"),
        (llama, 3, 1, r"pp=3 is more pipeline stages than the model's 2 decoder layers: use pp <= 2"),
    ],
)
def test_bad_degrees(make, pp, tp, match):
    with pytest.raises(ValueError, match=match):
        check_hf_degrees(make(), ParallelDims.of(pp=pp, tp=tp))


def test_bad_degrees_refused_before_launch():
    """The strategy's pre-launch check (no process group) asks HFCausalLM, which names the setting."""
    module = HFCausalLM(llama(num_key_value_heads=1))
    strategy = Hybrid3DStrategy(tp=2)
    with pytest.raises(ValueError, match=r"tp=2 does not divide the model's num_key_value_heads=1"):
        check_model(module, strategy.config, strategy.config.dims(2))


def test_a_mask_given_to_the_first_pipeline_layer_is_refused_naming_the_way():
    """Under pp the mask and position ids reach every stage as keyword inputs of the step (stage_inputs), not as
    arguments of the first layer."""
    embed = hf_pipeline_layers(llama())[0]
    with pytest.raises(TypeError, match=r"Under pp > 1 the first layer takes input_ids alone.*reach every stage"):
        embed(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4))


def test_model_without_plans_is_refused():
    model = llama()
    model.config.base_model_tp_plan = None
    with pytest.raises(ValueError, match=r"has no config.base_model_tp_plan.*tensor_parallel_plan\(\), or use tp=1"):
        hf_tensor_parallel_plan(model)
    model.config.base_model_pp_plan = {"embed_tokens": None}
    with pytest.raises(ValueError, match=r"base_model_pp_plan .* lists \['embed_tokens'\].*use pp=1"):
        hf_pipeline_layers(transformers.AutoModelForCausalLM.from_config(model.config))


def test_sequence_parallel_with_pipeline_refused_before_launch():
    module = HFCausalLM(llama())
    strategy = Hybrid3DStrategy(pp=2, tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True with pp > 1 .*set sequence_parallel=False or pp=1"):
        check_model(module, strategy.config, strategy.config.dims(4))


def test_lightning_strategies_read_the_whole_folder_in_configure_model(tmp_path):
    """Outside this package's strategies (here Lightning's single-device one) configure_model reads the folder."""
    model = llama()
    model.save_pretrained(tmp_path)
    module = HFCausalLM(str(tmp_path))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=4))
    assert module.weight_bytes_read == sum(p.numel() * p.element_size() for p in model.parameters())
    assert not torch.equal(module.model.lm_head.weight, model.lm_head.weight)  # read, then trained a step
