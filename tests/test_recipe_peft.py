"""recipes/train_gpt.py with ``peft=lora``: LoRA adapters on the tiny Llama under ZeRO at world 2 (the
trainable and frozen counts of metrics.json against the model's, the adapters alone holding gradients and
optimizer states), and the peft settings refused before any worker starts."""

from __future__ import annotations

import math

import pytest
import torch
import transformers  # a test dependency: make install installs the hf and peft extras
from recipe_runs import GPT
from recipe_runs import run_recipe as _run_recipe
from test_recipe_configs import compose_gpt

from lightning_parallel.recipes.gpt import check_config
from lightning_parallel.recipes.hf import hf_config
from lightning_parallel.recipes.metrics import parameter_counts

SHORT = ["trainer=debug", "trainer.max_steps=6", "sample_tokens=0"]
LORA = ["model=hf_llama_tiny", "peft=lora", "peft.r=4"]
UNIFORM = math.log(256)  # the loss of a uniform guess over the byte vocabulary, where training starts


def expected_counts(overrides: list[str]) -> tuple[int, int]:
    """(adapter, base) parameters of the composed Llama, from its config's shapes: every linear layer of a decoder
    layer (q, k, v, o, gate, up, down: peft's all-linear) gets A (r x in) and B (out x r)."""
    cfg = compose_gpt(*overrides)
    config, r = hf_config(cfg.model), cfg.peft.r
    d, ff, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    linears = [(d, d), (d, kv), (d, kv), (d, d), (d, ff), (d, ff), (ff, d)]  # (in, out)
    adapters = config.num_hidden_layers * sum(r * (i + o) for i, o in linears)
    with torch.device("meta"):
        base = parameter_counts(transformers.AutoModelForCausalLM.from_config(config))["trainable_params"]
    return adapters, base


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """The LoRA recipe in one process: the reference of the layouts below."""
    return _run_recipe(GPT, tmp_path_factory.mktemp("single"), *SHORT, *LORA)


@pytest.mark.slow  # recipe launches importing transformers and peft (over a minute at world 2 on a busy machine);
# the counts of the module the workers build are checked in-process below, the layouts' parity in test_hf_lora
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_lora_recipe_at_world_2_matches_one_process(strategy, single, tmp_path):
    adapters, base = expected_counts(LORA)
    assert (single["trainable_params"], single["frozen_params"]) == (adapters, base)
    assert math.isfinite(single["final_train_loss"]) and single["final_train_loss"] < UNIFORM - 0.1, single
    got = _run_recipe(GPT, tmp_path, *SHORT, *LORA, f"strategy={strategy}", "trainer.devices=2")
    assert (got["trainable_params"], got["frozen_params"]) == (adapters, base)
    assert got["steps"] == 6 and got["layout"]["world_size"] == 2
    want = single["final_train_loss"]
    assert abs(got["final_train_loss"] - want) <= 1e-5 * want, (got["final_train_loss"], want)
    for rank, states in enumerate(got["model_state_bytes"]):  # fp32: the adapters' gradients and AdamW states only
        assert 0 < states["grads"] <= 4 * math.ceil(adapters / 2), (rank, states)
        assert 0 < states["optimizer"] <= 8 * math.ceil(adapters / 2), (rank, states)


def test_recipe_module_counts_the_adapters_and_the_frozen_base():
    """What train() writes to metrics.json, from the module the workers build, without launching them."""
    from lightning_parallel.recipes.hf import build_hf_module

    cfg = compose_gpt(*LORA)
    module = build_hf_module(cfg)
    assert parameter_counts(module) == dict(zip(("trainable_params", "frozen_params"), expected_counts(LORA)))
    assert module.peft_config.r == 4 and module.peft_config.lora_alpha == 16.0
    plain = parameter_counts(build_hf_module(compose_gpt("model=hf_llama_tiny")))
    assert plain == {"trainable_params": expected_counts(LORA)[1], "frozen_params": 0}


def test_litgpt_gets_litgpt_s_own_lora_settings():
    """model=litgpt peft=lora: LitGPTCausalLM(lora=...) by LitGPT's names, every linear of the blocks by default."""
    from lightning_parallel.recipes.litgpt import build_litgpt_module

    cfg = compose_gpt("model=litgpt", "peft=lora", "peft.r=4", "peft.target_modules=[query,value]")
    check_config(cfg)
    module = build_litgpt_module(cfg)
    config = module.model.config
    assert (config.lora_r, config.lora_alpha, config.lora_query, config.lora_value) == (4, 16, True, True)
    assert not (config.lora_key or config.lora_mlp or config.lora_head)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    default = build_litgpt_module(compose_gpt("model=litgpt", "peft=lora")).model.config
    assert default.lora_mlp and default.lora_projection and not default.lora_head


def test_gpt2_conv1d_layers_get_fan_in_fan_out():
    from lightning_parallel.recipes.hf import build_hf_module

    module = build_hf_module(compose_gpt("model=hf_gpt2_tiny", "peft=lora"))
    assert module.peft_config.fan_in_fan_out is True
    assert not build_hf_module(compose_gpt(*LORA)).peft_config.fan_in_fan_out


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=hf_llama_tiny", "peft=lora", "peft.target_modules=[q_proj,v_proj]"],
        ["model=hf_gpt2_tiny", "peft=lora", "strategy=zero3", "trainer.devices=2"],
        ["model=hf_llama_tiny", "peft=lora", "strategy=hybrid3d", "strategy.tp=2", "trainer.devices=2"],
        ["model=litgpt", "peft=lora", "strategy=hybrid3d", "strategy.pp=2", "trainer.devices=2"],
    ],
    ids=["named-targets", "gpt2-zero3", "llama-tp2", "litgpt-pp2"],
)
def test_good_lora_settings_pass_the_checks(overrides):
    check_config(compose_gpt(*overrides))


def test_a_bf16_base_is_passed_to_the_module():
    """peft.base_dtype goes to HFCausalLM(base_dtype=...) when set (null never passes it): the base's weights in
    bf16, the adapters in fp32."""
    from lightning_parallel.recipes.hf import build_hf_module
    from lightning_parallel.recipes.lora import base_dtype_kwargs

    cfg = compose_gpt(*LORA, "peft.base_dtype=bfloat16")
    assert base_dtype_kwargs(cfg.peft) == {"base_dtype": torch.bfloat16}
    assert base_dtype_kwargs(compose_gpt(*LORA).peft) == {}
    check_config(cfg)
    dtypes = {p.dtype for n, p in build_hf_module(cfg).named_parameters() if "lora_" not in n and p.dim() > 1}
    adapters = {p.dtype for n, p in build_hf_module(cfg).named_parameters() if "lora_" in n}
    assert (dtypes, adapters) == ({torch.bfloat16}, {torch.float32})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=hf_llama_tiny", "peft.r=4"], r"peft.r=4 applies to LoRA adapters, and peft=none trains every weight"),
        (["peft=lora"], r"peft=lora with model=gpt_\* is not supported yet: .* or peft=none"),
        (["model=litgpt", "peft=lora", "peft.target_modules=[q_proj]"], r"LitGPT's LoRA adapts \['query', .*q_proj"),
        (["model=litgpt", "peft=lora", "peft.base_dtype=bfloat16"], r"peft.base_dtype=bfloat16 with model=litgpt"),
        (
            ["model=litgpt", "peft=lora", "strategy=hybrid3d", "strategy.cp=2", "trainer.devices=2"],
            r"cp=2 with LitGPTCausalLM\(lora=...\) is not supported yet: .*set cp=1",
        ),
        (["model=hf_llama_tiny", "peft=lora", "peft.r=0"], r"peft.r=0 is not a rank: set peft.r to 1 or more"),
        (["model=hf_llama_tiny", "peft=lora", "peft.alpha=0"], r"peft.alpha=0.0 must be positive"),
        (["model=hf_llama_tiny", "peft=lora", "peft.dropout=1.0"], r"peft.dropout=1.0 is not a probability"),
        (["model=hf_llama_tiny", "peft=lora", "peft.base_dtype=bf16"], r"peft.base_dtype='bf16' is unknown"),
        (["model=hf_llama_tiny", "peft=lora", "peft.method=ia3"], r"peft.method='ia3' is unknown: use peft=none or"),
        (["model=hf_llama_tiny", "peft=lora", "+peft.rank=4"], r"peft.rank is not a setting of the recipe"),
        (
            ["model=hf_llama_tiny", "peft=lora", "peft.target_modules=[attn]"],
            r"matches no module of LlamaForCausalLM .* adaptable modules are \['down_proj', .*"
            r"target_modules is peft.target_modules",
        ),
        (
            ["model=hf_llama_tiny", "peft=lora", "peft.dropout=0.1", "strategy=hybrid3d", "strategy.tp=2"]
            + ["trainer.devices=2"],
            r"lora_dropout=0.1\) with tp=2 is not supported yet.*lora_dropout is peft.dropout, tp is strategy.tp",
        ),
        (
            ["model=hf_llama_tiny", "peft=lora", "peft.target_modules=[embed_tokens]", "strategy=hybrid3d"]
            + ["strategy.tp=2", "trainer.devices=2"],
            r"LoRA on model.embed_tokens \(Embedding\) with tp > 1 is not supported yet",
        ),
    ],
    ids=[
        "key-without-lora",
        "native-gpt",
        "litgpt-targets",
        "litgpt-base-dtype",
        "litgpt-cp",
        "rank",
        "alpha",
        "dropout",
        "base-dtype",
        "method",
        "unknown-key",
        "targets-match-nothing",
        "dropout-under-tp",
        "embedding-under-tp",
    ],
)
def test_bad_peft_settings_are_refused_before_workers(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(compose_gpt(*overrides))


def test_sweep_summary_lists_the_parameter_counts(tmp_path):
    import json

    from lightning_parallel.recipes.summary import summarize

    layout = {"world_size": 2, "dp": 2, "pp": 1, "tp": 1, "zero_stage": 2, "precision": "32-true"}
    for job, counts in enumerate([(16384, 106816), (123200, 0)]):
        (tmp_path / str(job)).mkdir()
        metrics = {"layout": layout, "peak_memory_bytes": [1, 2], "steps": 6, "throughput": 1.0}
        metrics |= dict(zip(("trainable_params", "frozen_params"), counts))
        (tmp_path / str(job) / "metrics.json").write_text(json.dumps(metrics))
    rows = summarize(tmp_path)
    assert [(r["trainable_params"], r["frozen_params"]) for r in rows] == [(16384, 106816), (123200, 0)]
    assert "trainable_params,frozen_params" in (tmp_path / "summary.csv").read_text().splitlines()[0]
