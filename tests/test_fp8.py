"""precision=fp8 without a process group: the settings' refusals, which layers convert, the float8 tp styles, the
state dict's plain tensors, the recipe group (tests/test_fp8_parity.py: layouts against one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel.models import GPTConfig, RecipeGPT
from lightning_parallel.parallel.float8 import Float8Settings, convert, float8_tp_plan, is_float8_linear
from lightning_parallel.parallel.tensor.plan import path_matches
from lightning_parallel.plugins.float8 import Float8Precision

CPU = torch.device("cpu")


def test_settings_refuse_bad_combinations():
    with pytest.raises(ValueError, match="precision.recipe='blockwise' is unknown"):
        Float8Settings("blockwise")
    with pytest.raises(ValueError, match="fsdp_float8_all_gather=True with precision.recipe='rowwise'.*tensorwise"):
        Float8Settings("rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="recipe='rowwise' with tp=2.*set precision.recipe=tensorwise, or tp=1"):
        Float8Settings("rowwise").check_layout(tp=2)
    with pytest.raises(ValueError, match="fsdp_float8_all_gather=True with zero_stage=2.*strategy=zero3"):
        Float8Settings(fsdp_float8_all_gather=True).check_layout(zero_stage=2)
    Float8Settings(fsdp_float8_all_gather=True).check_layout(tp=2, zero_stage=3)
    with pytest.raises(ValueError, match="emulate=False on cpu"):
        convert(nn.Linear(16, 16), Float8Settings(emulate=False), CPU)


def test_gpt_converts_its_blocks_and_keeps_the_head_in_high_precision(caplog):
    model = RecipeGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32))
    report = convert(model, Float8Settings(), CPU)
    assert report["head.lm_head"] == "kept by name"
    assert {p for p, why in report.items() if why == "float8"} == {
        f"blocks.{i}.{m}" for i in range(2) for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")
    }
    assert not is_float8_linear(model.head.lm_head) and isinstance(model.embed.wte, nn.Embedding)
    assert model.head.lm_head.weight is model.embed.wte.weight  # the tie survives
    odd = nn.Sequential(nn.Linear(32, 24))
    assert convert(odd, Float8Settings(), CPU) == {"0": "32 x 24 is not a multiple of 16"}


def test_state_dict_holds_plain_high_precision_weights():
    model = nn.Sequential(nn.Linear(32, 32))
    convert(model, Float8Settings(fsdp_float8_all_gather=True), CPU)
    assert type(model[0].weight.data).__name__ == "WeightWithDynamicFloat8CastTensor"
    state = model.state_dict()
    assert type(state["0.weight"]) is torch.Tensor and state["0.weight"].dtype == torch.float32


def test_forward_backward_under_bf16_autocast_on_cpu():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    reference = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    reference.load_state_dict(model.state_dict())
    convert(model, Float8Settings(), CPU)
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = model(x), reference(x)
    assert y.dtype == torch.bfloat16  # the input and weight went through the autocast dtype
    assert 0 < (y.float() - want.float()).abs().max() < 0.1 * want.float().abs().max()  # float8, close to bf16
    y.float().sum().backward()
    assert model[0].weight.grad.dtype == torch.float32


def test_tp_plan_takes_float8_styles_on_converted_layers_only():
    model = RecipeGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32))
    convert(model, Float8Settings(), CPU)
    plan = {
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(),
        "head.lm_head": ColwiseParallel(),
    }
    got = float8_tp_plan(model, plan, path_matches)
    assert type(got["blocks.0.attn.q"]).__name__ == "Float8ColwiseParallel"
    assert type(got["blocks.1.mlp.proj"]).__name__ == "Float8RowwiseParallel"
    assert type(got["head.lm_head"]) is ColwiseParallel
    plain = RecipeGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32))
    assert float8_tp_plan(plain, plan, path_matches) == plan


def test_plugin_converts_when_the_strategy_takes_the_model():
    plugin = Float8Precision(device="cpu")
    assert plugin.precision == "bf16-mixed"  # ZeRO-3 gathers bf16 for what stays in high precision
    model = nn.Sequential(nn.Linear(32, 32))
    plugin.convert_module(model)
    assert plugin.report == {"0": "float8"} and is_float8_linear(model[0])


def test_recipe_refuses_fp8_where_it_cannot_run(tmp_path):
    from omegaconf import OmegaConf

    from lightning_parallel import ZeroStrategy
    from lightning_parallel.recipes.checks import check_precision

    def cfg(strategy: dict, **precision):
        p = {"value": "fp8", "recipe": "tensorwise", "fsdp_float8_all_gather": False, "emulate": None, **precision}
        return OmegaConf.create({"precision": p, "strategy": strategy})

    zero2 = {"name": "zero2"}
    with pytest.raises(ValueError, match="fsdp_float8_all_gather=True with zero_stage=2"):
        check_precision(cfg(zero2, fsdp_float8_all_gather=True), ZeroStrategy(stage=2))
    with pytest.raises(ValueError, match="precision.value='fp8' is not supported by strategy=ddp"):
        check_precision(cfg({"name": "ddp"}), "ddp")


@pytest.mark.slow  # transformers and peft imports: seconds
def test_lora_base_layers_convert_frozen_and_adapters_stay_high_precision():
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = get_peft_model(
        transformers.AutoModelForCausalLM.from_config(config), LoraConfig(r=16, target_modules=["q_proj", "v_proj"])
    )
    report = convert(model, Float8Settings(), CPU)
    base = [p for p in report if p.endswith("q_proj.base_layer")]
    assert base and report[base[0]] == "float8"
    assert all(why == "kept by name" for p, why in report.items() if ".lora_" in p)  # r=16 would convert otherwise
    ids = torch.randint(0, 128, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)  # the frozen float8 base has no gradient


def test_fabric_plugin_converts_in_setup_and_runs_under_bf16_autocast():
    import lightning as L

    from lightning_parallel.plugins.float8 import Float8FabricPrecision

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[Float8FabricPrecision()])
    model = fabric.setup_module(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    assert is_float8_linear(model.module[0]) and is_float8_linear(model.module[2])
    x = torch.randn(4, 32)
    y = model(x)  # under the plugin's bf16 autocast (Fabric hands the output back in fp32)
    assert torch.equal(y, y.bfloat16().float()) and not torch.equal(y, model.module.float()(x))
    fabric.backward(y.sum())
    assert model.module[0].weight.grad.dtype == torch.float32


def test_a_gpu_below_compute_capability_8_9_is_refused_by_name_unless_emulated(monkeypatch, caplog):
    from lightning_parallel.parallel import float8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\).*emulate=True"):
        float8.resolve_emulate(Float8Settings(), cuda)
    assert float8.resolve_emulate(Float8Settings(emulate=True), cuda) is True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8.resolve_emulate(Float8Settings(), cuda) is False  # an H100 / H200: real float8 GEMMs
    monkeypatch.setattr(float8, "_said_emulated", False)
    with caplog.at_level("WARNING", logger=float8.__name__):
        assert float8.resolve_emulate(Float8Settings(), CPU) and float8.resolve_emulate(Float8Settings(), CPU)
    assert [r.message for r in caplog.records].count(
        "precision=fp8 on cpu: float8 matmuls emulated (same numerics, no speed-up)"
    ) == 1  # said once
