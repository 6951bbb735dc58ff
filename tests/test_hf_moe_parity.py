"""Hugging Face MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3) with their experts split over ep: the same 10 AdamW
steps as the plain HF model trained in one process (its own forward and loss, load-balancing loss included), and
the single-process pieces (HF's auxiliary loss over a split batch, the plan read from base_model_ep_plan, the
refusals)."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from causal_lm_parity import SEQ_LEN, launch, options, train_reference
from conftest import Batch
from parity import assert_same_losses, assert_same_params
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel.hf import HFCausalLM
from lightning_parallel.hf.experts import HFExperts, hf_expert_parallel_plan, router_aux_loss
from lightning_parallel.hf.families import hf_tensor_parallel_plan
from lightning_parallel.hf.lora import apply_peft
from lightning_parallel.parallel.expert.apply import check_expert_layout
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.parallel.tensor.plan import check_tp_plan
from lightning_parallel.parallel.tensor.styles import HiddenStatesInput

DENSE = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": 64, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}  # fmt: skip
# the load-balancing loss weighted 0.1 (HF's default 0.001 would hide a wrong gradient under the 1e-5 bars)
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.1}
FIELDS = {
    "mixtral": {"model_type": "mixtral", **DENSE, **AUX, "num_key_value_heads": 2, "intermediate_size": 64,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    # no renormalization of the top-k weights (Qwen3-MoE's default), 8 experts of which 3 per token
    "qwen3_moe": {"model_type": "qwen3_moe", **DENSE, **AUX, "num_key_value_heads": 2, "head_dim": 8,
                  "intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 3},
    # sigmoid scores, 2 groups of 4 experts of which 1 group is chosen, scaled weights, a shared expert, a dense
    # first layer, multi-head latent attention; HF gives it no auxiliary loss
    "deepseek_v3": {"model_type": "deepseek_v3", **DENSE, "num_key_value_heads": 4, "intermediate_size": 64,
                    "moe_intermediate_size": 16, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
                    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8},
}  # fmt: skip
# under pp HF's auxiliary loss (over every layer's routers) is refused: the model without it
FIELDS["mixtral_plain"] = {**FIELDS["mixtral"], "output_router_logits": False}
# a dense first layer (its MLP at the MoE blocks' path, split by tp), MoE after it
FIELDS["qwen3_moe_dense0"] = {**FIELDS["qwen3_moe"], "mlp_only_layers": [0]}
EXPERTS = {"mixtral": 4, "mixtral_plain": 4, "qwen3_moe": 8, "qwen3_moe_dense0": 8, "deepseek_v3": 8}

# label -> (world, strategy spec, model, tp); "clip" clips at 0.05, "accum" accumulates 2 micro-batches per step
FAST = {
    "mixtral ep2 clip": (2, "hybrid3d:ep=2", "mixtral", 1),
    "qwen3_moe ep2 accum": (2, "hybrid3d:ep=2", "qwen3_moe", 1),
}
SLOW = {
    "mixtral ep2 zero3 accum w2": (2, "hybrid3d:ep=2,zero_stage=3", "mixtral", 1),
    "deepseek_v3 ep2 clip": (2, "hybrid3d:ep=2", "deepseek_v3", 1),
}
WIDE = {
    "mixtral dp4 ep2 zero3 clip": (4, "hybrid3d:ep=2,zero_stage=3", "mixtral", 1),
    "qwen3_moe dp4 ep2 zero3 accum": (4, "hybrid3d:ep=2,zero_stage=3", "qwen3_moe", 1),
    "deepseek_v3 dp4 ep2 zero3": (4, "hybrid3d:ep=2,zero_stage=3", "deepseek_v3", 1),
    "qwen3_moe ep4 zero1": (4, "hybrid3d:ep=4,zero_stage=1", "qwen3_moe", 1),
}

# ep composed with tp (experts replicated over tp, each tp rank exchanging with the ep ranks of its tp index) and pp
COMPOSED = {
    "mixtral ep2 tp2 clip": (4, "hybrid3d:ep=2,tp=2", "mixtral", 2),
    "mixtral_plain pp2 ep2 accum": (4, "hybrid3d:pp=2,ep=2,microbatches=2", "mixtral_plain", 1),
}


# tp for the families whose dense MLPs share the MoE blocks' path: the dense layers' MLPs, attention where HF's
# plan splits it (not DeepSeek's) and DeepSeek's shared experts over tp, the routed experts over ep
TENSOR = {
    "qwen3_moe_dense0 ep2 tp2 clip accum": (4, "hybrid3d:ep=2,tp=2", "qwen3_moe_dense0", 2),
    "deepseek_v3 ep2 tp2 clip accum": (4, "hybrid3d:ep=2,tp=2", "deepseek_v3", 2),
}


# world 8: tp=2 inside, the 4 data-parallel ranks split as ep=2 x dp=2 (experts data-parallel over 2 ranks)
WORLD8 = {"mixtral ep2 tp2 dp2 clip": (8, "hybrid3d:ep=2,tp=2", "mixtral", 2)}

# pp with HF's auxiliary loss: each pipeline microbatch its own batch for the loss, as each accumulated micro-batch
# (the reference accumulates microbatches x accumulate global micro-batches per step)
PIPELINE = {
    "mixtral pp2 ep2 clip accum": (4, "hybrid3d:pp=2,ep=2,microbatches=2", "mixtral", 1),
    "qwen3_moe pp2 ep2 accum": (4, "hybrid3d:pp=2,ep=2,microbatches=2", "qwen3_moe", 1),
    "deepseek_v3 pp2 ep2 clip": (4, "hybrid3d:pp=2,ep=2,microbatches=2", "deepseek_v3", 1),
}


# LoRA (peft) on a MoE model's attention with the frozen experts split over ep
MOE_LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
FIELDS["mixtral_lora"] = FIELDS["mixtral"]
EXPERTS["mixtral_lora"] = 4
LORA_RUNS = {"mixtral_lora ep2 clip": (2, "hybrid3d:ep=2", "mixtral_lora", 1)}


def config_of(name: str, **changes) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model(**{**FIELDS[name], **changes})


def moe_launch(tmp_path_factory, runs: dict, tag: str) -> Batch:
    extra = {name: {"config": fields} for name, fields in FIELDS.items()}
    extra["mixtral_lora"]["lora"] = MOE_LORA
    return launch(tmp_path_factory, dict.fromkeys(FIELDS, ""), runs, tag, "hf", extra)


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory) -> Batch:
    return moe_launch(tmp_path_factory, FAST, "hf_moe")


# the slow launches (make test-full), one per group: its tag -> its runs (one world size each)
GROUPS = {"hf_moe_slow": SLOW, "hf_moe_w4": WIDE, "hf_moe_composed": COMPOSED, "hf_moe_tp": TENSOR,
          "hf_moe_w8": WORLD8, "hf_moe_pp": PIPELINE, "hf_moe_lora": LORA_RUNS}  # fmt: skip
_launched: dict[str, Batch] = {}


def group_runs(tmp_path_factory, tag: str) -> Batch:
    """The group's launch, started the first time one of its runs is checked."""
    if tag not in _launched:
        _launched[tag] = moe_launch(tmp_path_factory, GROUPS[tag], tag)
    return _launched[tag]


def plain_hf_training(config: transformers.PretrainedConfig, clip: float | None, accumulate: int, lora: bool = False):
    """The reference: HF's model built after seed 0 (as the workers build it: from the config alone, initialized in
    one process; with LoRA whole on the host, transformers' own draws), its forward and loss (``labels=``, the
    load-balancing loss added by HF), trained here on the workers' global micro-batches, ``accumulate`` of them per
    step (HF's auxiliary loss is a product of batch means: each micro-batch's own)."""
    torch.manual_seed(0)
    if lora:
        model = apply_peft(transformers.AutoModelForCausalLM.from_config(config), peft.LoraConfig(**MOE_LORA))
    else:
        module = HFCausalLM(config)
        module.materialize()
        model = module.model
    return train_reference(
        model, config.vocab_size, lambda m, ids: m(input_ids=ids, labels=ids).loss,
        HFCausalLM.__init__.__defaults__, clip, accumulate,
    )  # fmt: skip


_references: dict = {}


def reference(name: str, label: str, microbatches: int = 1, **changes):
    opts = options(label)
    accumulate = opts["accumulate"] * microbatches
    key = (name, opts["clip"], accumulate, tuple(sorted(changes.items())))
    if key not in _references:
        _references[key] = plain_hf_training(config_of(name, **changes), opts["clip"], accumulate, "lora" in name)
    return _references[key]


def check_moe(runs: Batch, label: str, spec: tuple, microbatches: int = 1) -> None:
    """Losses and final parameters against the reference, and every rank holding E/ep experts of each layer."""
    world, strategy, name, _ = spec
    ep = int(strategy.split("ep=")[1].split(",")[0])
    run = runs[label]
    want_losses, want_params = reference(name, label, microbatches)
    loss_rel = assert_same_losses(run.losses("train"), want_losses, label)
    param_abs = assert_same_params(run.params("train"), want_params, label)
    held = {rank: run.case("train", rank)["experts_held"] for rank in range(world)}
    assert all(held.values()) or "pp=" in strategy, f"{label}: a rank holds no expert tensor"
    assert any(held.values()), f"{label}: no rank holds an expert tensor"  # under pp a stage may hold none
    for rank in range(world):
        for tensor, (shape, axes) in held[rank].items():
            assert "ep" in axes and shape[0] <= EXPERTS[name] // ep, f"{label} rank {rank}: {tensor} {shape} {axes}"
    print(f"{label}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")


@pytest.mark.parametrize("label", list(FAST))
def test_hf_moe_parity(label, fast_runs):
    check_moe(fast_runs, label, FAST[label])


@pytest.mark.slow
@pytest.mark.parametrize(("tag", "label"), [(tag, label) for tag, runs in GROUPS.items() for label in runs])
def test_hf_moe_parity_wider(tag, label, tmp_path_factory):
    """The wider layouts; under pp each microbatch is a batch of HF's auxiliary loss (hf/moe_pipeline.py: the
    reference accumulates microbatches x accumulate micro-batches); LoRA on a
    MoE model's attention: the adapters train as in one process and the frozen experts stay as built (the
    reference's, which never trains them)."""
    runs, spec = group_runs(tmp_path_factory, tag), GROUPS[tag][label]
    micro = int(spec[1].split("microbatches=")[1].split(",")[0]) if "microbatches=" in spec[1] else 1
    check_moe(runs, label, spec, micro)
    if "lora" in label:
        got, want = runs[label].params("train"), reference(spec[2], label)[1]
        assert [k for k in got if "lora_" in k], f"{label}: no adapters"
        experts = [k for k in got if ".experts." in k]
        assert experts and all(torch.equal(got[k], want[k]) for k in experts), f"{label}: frozen experts changed"


def test_the_auxiliary_loss_changes_the_reference():
    """The parity runs test HF's load-balancing loss: without it the reference ends elsewhere."""
    with_aux = reference("mixtral", "mixtral ep2 clip")[1]
    without = reference("mixtral", "mixtral ep2 clip", output_router_logits=False)[1]
    assert max((with_aux[k] - without[k]).abs().max().item() for k in with_aux) > 1e-4


# ----- single process -----


@pytest.mark.parametrize("masked", [False, True])
def test_router_aux_loss_is_hfs_load_balancing_loss(masked):
    """In one process :func:`router_aux_loss` is HF's ``load_balancing_loss_func``: value and gradient."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = transformers.AutoModelForCausalLM.from_config(config_of("mixtral"))
    g = torch.Generator().manual_seed(1)
    logits = tuple(torch.randn(24, 4, generator=g, requires_grad=True) for _ in range(2))
    mask = (torch.rand(3, 8, generator=g) > 0.3).long() if masked else None
    want = load_balancing_loss_func(logits, 4, 2, mask)
    got = router_aux_loss(logits, model, mask, None, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    want_grads = torch.autograd.grad(want, logits)
    got_grads = torch.autograd.grad(got, logits)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(FIELDS))
def test_hfcausallm_loss_is_hfs_loss(name):
    """HFCausalLM's loss in one process is HF's own ``loss`` (the load-balancing loss added where HF adds it)."""
    torch.manual_seed(0)
    module = HFCausalLM(config_of(name))
    module.materialize()  # built on meta from the config: its weights made here
    ids = torch.randint(0, 128, (2, SEQ_LEN))
    want = module.model(input_ids=ids, labels=ids).loss
    got = module.loss(module(ids), ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_plan_is_read_from_base_model_ep_plan():
    module = HFCausalLM(config_of("qwen3_moe"))
    plan = module.expert_parallel_plan()
    assert list(plan) == ["model.model.layers.*.mlp.experts"] and isinstance(
        plan["model.model.layers.*.mlp.experts"], HFExperts
    )
    check_expert_layout(module, 4, plan)  # 8 experts split 4 ways
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 experts of model.model.layers.0.mlp.experts"):
        check_expert_layout(module, 3, plan)
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DENSE, intermediate_size=64))
    assert hf_expert_parallel_plan(dense) == {}


def test_unknown_ep_styles_are_refused():
    model = transformers.AutoModelForCausalLM.from_config(config_of("mixtral"))
    model.config.base_model_ep_plan = {"layers.*.mlp.experts": "some_future_style"}
    with pytest.raises(ValueError, match="'some_future_style' for 'layers.*.mlp.experts'.*use ep=1"):
        hf_expert_parallel_plan(model)


@pytest.mark.parametrize(
    ("name", "degrees", "match"),
    [
        ("llama", {"ep": 2}, "ep=2 splits the experts of MoE models, and this llama model has none"),
    ],
)
def test_layouts_refused_by_name(name, degrees, match):
    config = transformers.LlamaConfig(**DENSE, intermediate_size=64) if name == "llama" else config_of(name)
    module = HFCausalLM(config)
    with pytest.raises(ValueError, match=match):
        module.check_parallel_degrees(ParallelDims.of(**degrees))


@pytest.mark.slow
def test_recipe_trains_tiny_mixtral_at_ep2(tmp_path):
    """recipes/train_gpt.py model=hf_mixtral_tiny strategy.ep=2: trains, validates and samples, experts split."""
    from test_hf_recipe import assert_trained, run_recipe

    got = run_recipe(tmp_path, "model=hf_mixtral_tiny", "strategy=hybrid3d", "strategy.ep=2", "trainer.devices=2")
    assert_trained(got, world=2)
    assert got["layout"]["ep"] == 2


def test_tp_plan_splits_dense_mlps_at_the_moe_blocks_path():
    """Qwen3-MoE with a dense first layer, DeepSeek-V3: the dense MLP and DeepSeek's shared experts split over tp
    (each taking its input once), the MoE blocks themselves and their experts untouched (ep splits those)."""
    qwen = transformers.AutoModelForCausalLM.from_config(config_of("qwen3_moe_dense0"))
    plan = hf_tensor_parallel_plan(qwen)
    assert isinstance(plan["model.layers.0.mlp"], HiddenStatesInput)
    assert isinstance(plan["model.layers.0.mlp.gate_proj"], ColwiseParallel)
    assert not [p for p in plan if p.startswith(("model.layers.1.mlp", "model.layers.*.mlp"))], plan
    check_tp_plan(qwen, plan, 2)
    deepseek = transformers.AutoModelForCausalLM.from_config(config_of("deepseek_v3"))
    plan = hf_tensor_parallel_plan(deepseek)
    assert isinstance(plan["model.layers.1.mlp.shared_experts"], HiddenStatesInput)
    assert isinstance(plan["model.layers.1.mlp.shared_experts.down_proj"], RowwiseParallel)
    assert "model.layers.1.mlp" not in plan and not [p for p in plan if ".experts" in p], plan
    check_tp_plan(deepseek, plan, 2)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("qwen3_moe", "sequence_parallel=True with this qwen3_moe model and config.output_router_logits=True"),
        ("deepseek_v3", "sequence_parallel=True with this deepseek_v3 model: its tp plan .* does not split attention"),
    ],
)
def test_sequence_parallel_refused_where_routers_or_attention_would_see_a_slice(name, match):
    model = transformers.AutoModelForCausalLM.from_config(config_of(name))
    with pytest.raises(ValueError, match=match):
        hf_tensor_parallel_plan(model, sequence_parallel=True)


def test_pipeline_aux_loss_refuses_activation_checkpointing():
    """Under pp with HF's auxiliary loss a recomputed layer would miss the stages' exchange: refused by name."""
    from types import SimpleNamespace

    from lightning_parallel.hf.moe_pipeline import pipeline_router_aux

    model = transformers.AutoModelForCausalLM.from_config(config_of("mixtral"))
    strategy = SimpleNamespace(
        parallel_dims=SimpleNamespace(pp=2), config=SimpleNamespace(activation_checkpointing="full")
    )
    with pytest.raises(ValueError, match="activation_checkpointing='full' with pp=2 and config.output_router_logits"):
        pipeline_router_aux(model, strategy)
    plain = transformers.AutoModelForCausalLM.from_config(config_of("mixtral_plain"))
    assert pipeline_router_aux(plain, strategy) is None  # no auxiliary loss: HF's forward needs nothing


def test_pipeline_aux_loss_refuses_a_first_stage_that_trains_nothing():
    """A frozen first stage (LoRA adapters only on later layers) never runs its backward, so it would not take the
    last stage's totals of the load-balancing loss: refused by name, before the exchange starts."""
    from lightning_parallel.hf.moe_pipeline import PipelineRouterAux
    from lightning_parallel.parallel.pipeline.split import ElsewhereLayer

    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    layers = [frozen, ElsewhereLayer("model.layers.1", 1)]
    with pytest.raises(ValueError, match="first pipeline stage that trains nothing"):
        PipelineRouterAux(torch.nn.Module(), layers, None, None, None, 1)
