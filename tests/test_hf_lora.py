"""HFCausalLM(peft_config=LoraConfig(...)): peft's LoRA adapters on a frozen base under ZeRO 0-3 and tp=2 (with and
without sequence parallelism), against the same peft model (same adapter initialization) trained in one process by a
plain loop (and at cp=2, ring and Ulysses: make test-full); what each rank holds for the frozen base; the plan each
LoRA layer gets; bad input refused before any worker starts."""

from __future__ import annotations

import peft  # a test dependency: make install installs the peft extra
import pytest
import torch
import transformers
from causal_lm_parity import CLIP, check, check_frozen_base, launch, train_reference
from conftest import Batch
from parity import PARAM_ATOL
from test_hf_parity import CONFIGS
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.hf import HFCausalLM, hf_tensor_parallel_plan
from lightning_parallel.hf.lora import apply_peft
from lightning_parallel.parallel.tensor.styles import LoraParallel
from lightning_parallel.strategies.checks import check_model

# every linear layer of the blocks adapted; embeddings, norms and heads stay frozen (and keep their own tp styles)
LORA = {
    "llama": {
        "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
    "gpt2": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["c_attn", "c_proj", "c_fc"],
             "fan_in_fan_out": True},
}  # fmt: skip
MODELS = {name: CONFIGS[name] for name in LORA}

# label -> (world, strategy spec, model, tp), as tests/test_hf_parity.py; "clip" clips the gradient norm
FAST = {
    "llama lora zero2 clip": (2, "zero2", "llama", 1),
    "llama lora tp2 clip": (2, "hybrid3d:tp=2", "llama", 2),
}
SLOW = {
    "llama lora zero0": (2, "hybrid3d:zero_stage=0", "llama", 1),
    "llama lora zero1": (2, "zero1", "llama", 1),
    "llama lora zero3 clip": (2, "zero3", "llama", 1),
    "llama lora tp2 sp clip": (2, "hybrid3d:tp=2,sequence_parallel=1", "llama", 2),
    "gpt2 lora zero2": (2, "zero2", "gpt2", 1),
    "gpt2 lora zero3 clip": (2, "zero3", "gpt2", 1),
    "gpt2 lora tp2": (2, "hybrid3d:tp=2", "gpt2", 2),
    "gpt2 lora tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "gpt2", 2),
}

# context parallelism with adapters: HF's attention through the cp attention function, LoRA on its projections
CONTEXT = {
    "llama lora cp2 ring clip": (2, "hybrid3d:cp=2", "llama", 1),
    "llama lora cp2 ulysses": (2, "hybrid3d:cp=2,cp_mode=ulysses", "llama", 1),
}


def lora_config(model: str) -> peft.LoraConfig:
    return peft.LoraConfig(**LORA[model])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, config in MODELS.items():
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(f"lora_{name}")
        transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(folder)
        out[name] = str(folder)
    return out


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, FAST, "lora", "hf", extra={m: {"lora": c} for m, c in LORA.items()})


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, SLOW, "lora_slow", "hf", extra={m: {"lora": c} for m, c in LORA.items()})


@pytest.fixture(scope="module")
def context_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, CONTEXT, "lora_cp", "hf", extra={m: {"lora": c} for m, c in LORA.items()})


def plain_lora_training(name: str, folder: str, clip: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the same peft model (adapters from the same seed), HF's forward and loss, a plain loop."""
    model = apply_peft(transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True),
                       lora_config(name))  # fmt: skip
    return train_reference(
        model, model.config.vocab_size, lambda m, ids: m(input_ids=ids, labels=ids).loss,
        HFCausalLM.__init__.__defaults__, clip,
    )  # fmt: skip


@pytest.fixture(scope="module")
def references(folders) -> dict:
    return {(name, clip): plain_lora_training(name, folder, clip) for name, folder in folders.items() for clip in
            (None, CLIP)}  # fmt: skip


def check_lora_run(runs: Batch, label: str, spec: tuple, references: dict, folders: dict) -> None:
    """Losses and adapters as the reference's; the frozen base bitwise as the folder holds it."""
    check(runs, label, spec, references)
    got = runs[label].params("train")
    model = spec[2]
    initial = apply_peft(transformers.AutoModelForCausalLM.from_pretrained(folders[model]), lora_config(model))
    base = {f"model.{k}": v for k, v in initial.state_dict().items() if "lora_" not in k}
    adapters = [k for k in got if "lora_" in k]
    assert adapters and len(base) + len(adapters) == len(got)
    changed = [k for k, v in base.items() if not torch.equal(got[k], v)]
    assert not changed, f"{label}: frozen base parameters changed: {changed[:5]}"


@pytest.mark.parametrize("label", list(FAST))
def test_lora_parity(label, fast_runs, references, folders):
    check_lora_run(fast_runs, label, FAST[label], references, folders)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_lora_parity_wider(label, slow_runs, references, folders):
    check_lora_run(slow_runs, label, SLOW[label], references, folders)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(CONTEXT))
def test_lora_parity_context_parallel(label, context_runs, references, folders):
    check_lora_run(context_runs, label, CONTEXT[label], references, folders)


@pytest.mark.parametrize("model", list(LORA))
def test_clipping_is_active_in_the_lora_reference(model, references):
    """A "clip" run that did not clip would fail parity: clipping moves the reference's adapters by far more than
    the tolerance (AdamW nearly undoes a constant scale, so less than the 1e-3 of full fine-tuning: seen 1.6e-3 for
    Llama and 9.5e-4 for GPT-2)."""
    plain, clipped = references[model, None][1], references[model, CLIP][1]
    assert max((plain[k] - clipped[k]).abs().max().item() for k in plain) > 20 * PARAM_ATOL


def check_frozen_base_holds_nothing(runs: Batch, label: str, spec: tuple) -> None:
    model = spec[2]
    check_frozen_base(
        runs, label, spec, [p for p in apply_peft(small(model), lora_config(model)).parameters() if p.requires_grad]
    )


@pytest.mark.parametrize("label", list(FAST))
def test_frozen_base_has_no_gradient_or_optimizer_state(label, fast_runs):
    check_frozen_base_holds_nothing(fast_runs, label, FAST[label])


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_frozen_base_has_no_gradient_or_optimizer_state_wider(label, slow_runs):
    check_frozen_base_holds_nothing(slow_runs, label, SLOW[label])


# ----- no process group -----


def small(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(MODELS[name]())


def test_module_wraps_with_peft_and_freezes_the_base():
    module = HFCausalLM(small("llama"), peft_config=lora_config("llama"))
    assert isinstance(module.model, peft.PeftModel)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert "model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in trainable
    optimized = {id(p) for g in module.configure_optimizers().param_groups for p in g["params"]}
    assert optimized == {id(p) for p in module.parameters() if p.requires_grad}
    base = small("llama")
    torch.manual_seed(1)  # the adapters come from adapter_seed, whatever the global generator holds
    again = HFCausalLM(base, peft_config=lora_config("llama"))
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight"
    assert torch.equal(module.model.get_parameter(name), again.model.get_parameter(name))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_plan_gives_lora_layers_their_base_style(sequence_parallel):
    plain = hf_tensor_parallel_plan(small("llama"), sequence_parallel)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"], layers_to_transform=[1])
    plan = hf_tensor_parallel_plan(apply_peft(small("llama"), config), sequence_parallel)
    prefix = "base_model.model."
    assert set(plan) - {prefix + p for p in plain} == {
        f"{prefix}model.layers.{i}.{path}" for i in (0, 1) for path in ("self_attn.q_proj", "mlp.down_proj")
    }
    q, down = plan[prefix + "model.layers.1.self_attn.q_proj"], plan[prefix + "model.layers.1.mlp.down_proj"]
    assert isinstance(q, LoraParallel) and isinstance(q.base_style, ColwiseParallel) and q.kind == "col"
    assert isinstance(down, LoraParallel) and isinstance(down.base_style, RowwiseParallel) and down.kind == "row"
    assert isinstance(plan[prefix + "model.layers.0.self_attn.q_proj"], ColwiseParallel)  # layer 0: no adapter
    assert isinstance(plan[prefix + "model.layers.*.self_attn.k_proj"], ColwiseParallel)
    assert type(plan[prefix + "lm_head"]) is ColwiseParallel


def test_gpt2_fused_projection_keeps_its_parts():
    plan = hf_tensor_parallel_plan(apply_peft(small("gpt2"), lora_config("gpt2")))
    c_attn = plan["base_model.model.transformer.h.*.attn.c_attn"]
    assert isinstance(c_attn, LoraParallel) and c_attn.parts == 3 and c_attn.kind == "col"
    assert plan["base_model.model.transformer.h.*.mlp.c_proj"].kind == "row"


def test_target_modules_matching_nothing_are_refused_with_what_the_model_has():
    config = peft.LoraConfig(r=4, target_modules=["query", "value"])
    with pytest.raises(ValueError, match=r"matches no module of LlamaForCausalLM.*'o_proj'.*'q_proj'.*'v_proj'"):
        HFCausalLM(small("llama"), peft_config=config)
    with pytest.raises(ValueError, match=r"matches no module of GPT2LMHeadModel.*'c_attn'"):
        HFCausalLM(small("gpt2"), peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"]))


def test_adapters_on_moe_experts_are_refused_by_name():
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=32,
    )  # fmt: skip
    mixtral = transformers.AutoModelForCausalLM.from_config(config)  # peft injects into the model it wraps: config
    with pytest.raises(ValueError, match=r"MoE routers or experts \(model.layers.0.mlp.experts\) is not supported"):
        HFCausalLM(mixtral, peft_config=peft.LoraConfig(r=4, target_modules=["experts"]))
    parameters = peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(ValueError, match=r"MoE routers or experts \(target_parameters=.*target_modules=\['q_proj'"):
        HFCausalLM(mixtral, peft_config=parameters)
    with pytest.raises(
        ValueError, match=r"MoE routers or experts \(base_model.model.model.layers.0.mlp.(gate|experts)\)"
    ):
        HFCausalLM(config, peft_config=peft.LoraConfig(r=4, target_modules="all-linear"))  # peft reaches them
    adapted = HFCausalLM(config, peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not any("experts" in n for n, p in adapted.named_parameters() if p.requires_grad)


def test_other_peft_methods_are_refused_naming_lora():
    with pytest.raises(TypeError, match=r"supports LoraConfig \(LoRA\), not IA3Config"):
        HFCausalLM(small("llama"), peft_config=peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[]))


def test_cp_and_ep_take_adapters():
    """cp=2 passes the checks with adapters (test_lora_parity_context_parallel trains it); ep=2 needs experts, which a
    dense Llama has none of (a MoE model's: tests/test_hf_moe_parity.py)."""
    module = HFCausalLM(small("llama"), peft_config=lora_config("llama"))
    strategy = Hybrid3DStrategy(cp=2)
    check_model(module, strategy.config, strategy.config.dims(2))
    strategy = Hybrid3DStrategy(ep=2)
    with pytest.raises(ValueError, match="ep=2 splits the experts of MoE models, and this llama model has none"):
        check_model(module, strategy.config, strategy.config.dims(2))


@pytest.mark.parametrize(
    ("setting", "match"),
    [({"lora_dropout": 0.1}, r"lora_dropout=0.1\) with tp=2 is not supported yet"), ({"use_dora": True}, "use_dora")],
)
def test_lora_variants_tp_does_not_split_are_refused(setting, match):
    module = HFCausalLM(small("llama"), peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"], **setting))
    strategy = Hybrid3DStrategy(tp=2)
    with pytest.raises(ValueError, match=match):
        check_model(module, strategy.config, strategy.config.dims(2))


def test_adapted_embedding_is_refused_under_tp():
    module = HFCausalLM(small("llama"), peft_config=peft.LoraConfig(r=4, target_modules=["embed_tokens"]))
    strategy = Hybrid3DStrategy(tp=2)
    with pytest.raises(ValueError, match=r"LoRA on .*embed_tokens \(Embedding\) with tp > 1 is not supported yet"):
        check_model(module, strategy.config, strategy.config.dims(2))
