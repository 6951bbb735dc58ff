"""Issue 42, item 3: ZeRO-3 under ``bf16-mixed`` gathers bf16 parameters and reduces gradients in fp32, MoE routers
kept in fp32 by name. One launch at world 2 counts the bytes of one steady step of the tiny GPT (and of the GPT with
a MoE block) by collective and dtype (tests/workers/cases/collectives.py, ``CommCounter``) under ``32-true`` and
``bf16-mixed``. Numerics against one process: tests/test_zero_parity.py (``test_bf16_mixed_parity``)."""

from __future__ import annotations

import json

import pytest
import torch
from harness import run_worker
from torch import nn

from lightning_parallel.models import GPTConfig
from lightning_parallel.models.gpt import RecipeGPT
from lightning_parallel.parallel.data.fsdp import fsdp_units, precision_policy, router_units
from lightning_parallel.plugins.precision import param_dtype_for, param_dtype_of

SPECS = ["zero3", "zero3+bf16", "zero3+moe", "zero3+moe+bf16"]


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("collective_dtypes")
    ranks = run_worker("collectives", 2, ["--opts", json.dumps({"specs": SPECS})], out, timeout=300)
    assert ranks[0] == ranks[1]  # every rank issues the same collectives
    return ranks[0]


def test_zero3_bf16_mixed_gathers_half_the_bytes_and_reduces_in_fp32(counted):
    fp32, bf16 = counted["zero3"]["bytes"], counted["zero3+bf16"]["bytes"]
    print(f"zero3 world 2, one step, payload bytes: 32-true {fp32}, bf16-mixed {bf16}")
    assert fp32["all_gather:float32"] > 0 and "all_gather:bfloat16" not in fp32
    assert "all_gather:float32" not in bf16  # every parameter gathered in bf16
    assert bf16["all_gather:bfloat16"] * 2 == fp32["all_gather:float32"]
    # gradients: reduce-scattered in fp32 either way, the same bytes
    assert bf16["reduce_scatter:float32"] == fp32["reduce_scatter:float32"] > 0
    assert "reduce_scatter:bfloat16" not in bf16
    for spec in ("zero3+bf16", "zero3+moe+bf16"):  # fp32 master weights and optimizer states
        assert counted[spec]["param_dtypes"] == ["torch.float32"], spec
        assert counted[spec]["state_dtypes"] == ["torch.float32"], spec


def test_moe_router_is_gathered_in_fp32_and_the_rest_in_bf16(counted):
    fp32, bf16 = counted["zero3+moe"]["bytes"], counted["zero3+moe+bf16"]["bytes"]
    router = counted["zero3+moe+bf16"]["router_bytes"]
    print(f"zero3 MoE GPT world 2, one step, payload bytes: 32-true {fp32}, bf16-mixed {bf16}")
    kept = bf16["all_gather:float32"]  # the router's gathers, each its whole fp32 weight
    assert kept > 0 and kept % router == 0, (kept, router)
    assert bf16["all_gather:bfloat16"] * 2 == fp32["all_gather:float32"] - kept
    assert bf16["reduce_scatter:float32"] == fp32["reduce_scatter:float32"]


def test_router_units_are_found_by_name_beside_the_experts():
    config = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, d_model=32, moe_experts=4, moe_top_k=2)
    model = RecipeGPT(config)
    assert router_units(model) == ["blocks.1.mlp.router", "blocks.3.mlp.router"]
    assert router_units(RecipeGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32))) == []

    class Block(nn.Module):  # transformers' MoE blocks: ``gate`` beside ``experts``; a dense MLP's gate is no router
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.experts = nn.Linear(8, 4, bias=False), nn.Linear(8, 8)
            self.mlp = nn.Module()
            self.mlp.gate = nn.Linear(8, 8)

    assert router_units(nn.ModuleDict({"0": Block()})) == ["0.gate"]
    assert "blocks.1.mlp.router" not in fsdp_units(model)  # added only when the rest is gathered in bf16
    import transformers

    small = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
    families = {  # transformers 5's MoE blocks: the router is ``mlp.gate`` beside ``mlp.experts``
        "mixtral": {"num_local_experts": 4, "intermediate_size": 32},
        "deepseek_v3": {"n_routed_experts": 4, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                        "moe_intermediate_size": 8, "intermediate_size": 32, "q_lora_rank": None, "kv_lora_rank": 8,
                        "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4},
    }  # fmt: skip
    for family, fields in families.items():
        config = transformers.AutoConfig.for_model(family, **small, **fields)
        hf = transformers.AutoModelForCausalLM.from_config(config)
        want = [f"model.layers.{i}.mlp.gate" for i in range(2) if family != "deepseek_v3" or i >= 1]
        assert router_units(hf) == want, family


def test_the_precision_decides_the_gather_dtype():
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    from lightning_parallel import Hybrid3DFabricStrategy, Hybrid3DStrategy

    trainer_side, fabric_side = Hybrid3DStrategy(zero_stage=3), Hybrid3DFabricStrategy(zero_stage=3)
    trainer_side.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    fabric_side.precision = FabricMixed("bf16-mixed", "cpu")
    for strategy in (trainer_side, fabric_side):  # what setup_environment hands the sharding
        assert param_dtype_for(strategy._precision_name()) is torch.bfloat16, type(strategy).__name__
    assert param_dtype_for(Hybrid3DStrategy(zero_stage=3)._precision_name()) is None

    assert param_dtype_of(MixedPrecision("bf16-mixed", "cpu")) is torch.bfloat16
    assert param_dtype_of(FabricMixed("bf16-mixed", "cpu")) is torch.bfloat16
    assert param_dtype_of(MixedPrecision("16-mixed", "cpu")) is None
    assert param_dtype_of(HalfPrecision("bf16-true")) is None  # the parameters are bf16 already
    assert param_dtype_of(Precision()) is None
    policy = precision_policy(torch.bfloat16, None)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert precision_policy(torch.bfloat16, torch.float16).reduce_dtype == torch.float16  # grad_compression='fp16'
    assert precision_policy(None, None).reduce_dtype is None
