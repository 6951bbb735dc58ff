"""precision=fp8 and MoE experts (parallel/float8_experts.py), in one process: which kernel the experts' grouped
multiply gets (bf16 on the CPU, said once in the log; torchao's float8 grouped GEMM on CUDA 9.0+ with triton), what an
HF Qwen3 / Mixtral / Qwen3-MoE converts, the HF experts' forward (HF's own numbers in fp32, bf16 operands under the
autocast), and the float8 path's padding and operand layouts with a stand-in for torchao's CUDA kernel that checks
torchao's asserts. Multi-process parity: tests/test_fp8_hf_families.py."""

from __future__ import annotations

import copy
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_fp8_hf_families import QWEN3
from test_hf_moe_parity import config_of

import lightning_parallel._compat as _compat
from lightning_parallel.hf import HFCausalLM
from lightning_parallel.parallel import float8_experts
from lightning_parallel.parallel.expert.experts import GroupedExperts
from lightning_parallel.parallel.float8 import Float8Settings, convert, is_float8_linear
from lightning_parallel.parallel.float8_experts import BF16, FLOAT8, experts_kernel, pad_groups, padded_grouped
from lightning_parallel.planning.analytic import _Rank, evaluate
from lightning_parallel.planning.cluster import Cluster, get_device
from lightning_parallel.planning.fp8 import converted_kinds, fp8_flop_share
from lightning_parallel.planning.hf_config import from_hf_config
from lightning_parallel.planning.layout import Layout, Workload

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_the_experts_kernel_is_chosen_by_device_and_said(monkeypatch):
    assert experts_kernel(CPU, True)[0] == BF16 and "CUDA-only" in experts_kernel(CPU, True)[1]
    monkeypatch.setattr(torch.version, "hip", None)
    capability = {"value": (8, 9)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    assert experts_kernel(CUDA, False) == (BF16, "compute capability 8.9: torch's scaled grouped GEMM needs 9.0")
    capability["value"] = (9, 0)
    assert experts_kernel(CUDA, True)[0] == BF16  # emulation asked for: no emulated float8 grouped GEMM
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton fails
    assert experts_kernel(CUDA, False) == (BF16, "torchao's float8 grouped GEMM needs triton, which is not installed")
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    assert experts_kernel(CUDA, False) == (FLOAT8, "torchao's rowwise float8 grouped GEMM")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert experts_kernel(CUDA, False)[0] == BF16


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**QWEN3) if name == "qwen3" else config_of(name)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "qwen3_moe"])
def test_what_an_hf_family_converts(name, caplog, monkeypatch):
    monkeypatch.setattr(float8_experts, "_said", [])
    model = build(name)
    with caplog.at_level(logging.WARNING, logger=float8_experts.__name__):
        report = convert(model, Float8Settings(), CPU)
        convert(build(name), Float8Settings(), CPU)  # a second model: said once
    linears = {p for p, why in report.items() if why == "float8"}
    attention = {f"model.layers.{i}.self_attn.{n}_proj" for i in range(2) for n in "qkvo"}
    assert report["lm_head"] == "kept by name" and attention <= linears
    modules = dict(model.named_modules())
    assert all(is_float8_linear(modules[p]) for p in linears)
    routers = [p for p in modules if p.endswith(".mlp.gate")]
    experts = {p: why for p, why in report.items() if p.endswith(".experts")}
    said = [r.getMessage() for r in caplog.records if "experts" in r.getMessage()]
    if name == "qwen3":  # dense: its MLPs convert; the per-head q/k norms are norms, not Linear layers
        assert {f"model.layers.{i}.mlp.{n}_proj" for i in range(2) for n in ("gate", "up", "down")} <= linears
        assert all(type(modules[f"model.layers.{i}.self_attn.{n}"]).__name__ == "Qwen3RMSNorm" for i in range(2)
                   for n in ("q_norm", "k_norm"))  # fmt: skip
        assert not experts and not routers and not said
        return
    assert len(routers) == 2 and not any(is_float8_linear(modules[p]) for p in routers)  # the routers stay
    assert len(experts) == 2 and all(why.startswith("bf16 grouped GEMM (") for why in experts.values()), experts
    assert said == [f"precision=fp8: the MoE experts' grouped multiply runs in bf16 ({experts_kernel(CPU, True)[1]})"]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_hf_experts_forward(name, monkeypatch):
    """The converted experts compute HF's experts (fp32, no autocast) and multiply bf16 operands under the autocast,
    where HF's own would multiply the fp32 master weights (grouped_mm has no autocast rule)."""
    hf = build(name).model.layers[0].mlp.experts
    ours = copy.deepcopy(hf)
    convert(torch.nn.Sequential(ours), Float8Settings(), CPU)
    assert type(ours).__name__ == type(hf).__name__ and type(ours) is not type(hf)
    tokens, top_k = 12, hf.config.num_experts_per_tok
    x = torch.randn(tokens, hf.hidden_dim)
    index = torch.stack([torch.randperm(hf.num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    torch.testing.assert_close(ours(x, index, weights), hf(x, index, weights), rtol=1e-5, atol=1e-6)
    seen = []

    def spy(a, b, offs):
        seen.append((a.dtype, b.dtype))
        return grouped_mm(a, b, offs=offs)

    grouped_mm = F.grouped_mm
    monkeypatch.setattr(float8_experts.F, "grouped_mm", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x, index, weights)
    out.sum().backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2 and out.dtype == torch.float32
    assert ours.gate_up_proj.grad.dtype == torch.float32 and ours.gate_up_proj.grad.abs().sum() > 0


def test_padding_groups_for_the_float8_kernel():
    """Each group padded to 16 rows with zeros, the padded multiply unpadded: the same rows and gradients as the
    plain grouped multiply (empty groups and groups of 1 to 17 rows)."""
    x = torch.randn(37, 32, requires_grad=True)
    w = torch.randn(5, 48, 32, requires_grad=True)
    offsets = torch.tensor([5, 5, 20, 21, 37], dtype=torch.int32)
    padded, ends, index = pad_groups(x, offsets, 16)
    assert ends.tolist() == [16, 16, 32, 48, 64] and padded.shape[0] >= 64 and padded.shape[0] % 16 == 0
    assert torch.equal(padded[index], x) and padded[5:16].abs().sum() == 0
    want = F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    got = padded_grouped(x, w, offsets, lambda a, b, offs: F.grouped_mm(a, b, offs=offs))
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (x, w), grad), torch.autograd.grad(want, (x, w), grad)):
        torch.testing.assert_close(a, b)


def fake_float8_grouped_mm(calls: list):
    """torchao's float8 grouped GEMM's contract (its asserts, the padding it leaves to us), computed in bf16."""

    def kernel(a, b_t, offs, out_dtype=torch.bfloat16, float8_dtype=None, pad_token_groups_for_grouped_mm=True):
        assert not pad_token_groups_for_grouped_mm and offs.dtype == torch.int32
        assert a.is_contiguous() and a.shape[-1] % 16 == 0 and b_t.shape[-2] % 16 == 0 and b_t.shape[-1] % 16 == 0
        assert b_t.stride(-2) == 1 and b_t.stride(-1) == b_t.shape[-2]  # each expert column-major
        assert (offs % 16 == 0).all()
        calls.append(out_dtype)
        return F.grouped_mm(a, b_t, offs=offs).to(out_dtype)

    return kernel


def test_the_float8_path_with_a_stand_in_kernel(monkeypatch):
    """The CUDA path's plumbing on the CPU: HF's experts and the recipe's GroupedExperts routed through the float8
    grouped GEMM (a stand-in checking torchao's layout asserts) give what their bf16 grouped multiply gives."""
    calls: list = []
    monkeypatch.setattr(_compat, "float8_grouped_mm", lambda: fake_float8_grouped_mm(calls))
    monkeypatch.setattr(float8_experts, "experts_kernel", lambda device, emulate: (FLOAT8, "test"))
    hf = build("mixtral").model.layers[0].mlp.experts
    bf16 = copy.deepcopy(hf)
    float8_experts._convert_one(bf16, BF16, "test")
    assert convert(torch.nn.Sequential(hf), Float8Settings(), CPU) == {"0": "float8 grouped GEMM"}
    x, index, weights = torch.randn(12, 32), torch.randint(0, 4, (12, 2)), torch.rand(12, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(hf(x, index, weights), bf16(x, index, weights))
    assert calls == [torch.bfloat16] * 2
    torch.manual_seed(0)
    recipe = GroupedExperts(4, 32, 64, "swiglu")
    plain = copy.deepcopy(recipe)
    assert float8_experts._convert_one(recipe, FLOAT8, "test") == "float8 grouped GEMM"
    rows, counts = torch.randn(20, 32), torch.tensor([3, 0, 9, 8])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(rows, counts)
        got = recipe(rows, counts)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)
    assert len(calls) == 5 and got.dtype == torch.bfloat16


def test_converting_before_materialize_keeps_hf_initial_values():
    """The package's strategies convert a model built on meta before they materialize it: the swapped-in
    Float8Linear layers get HF's initial values at their paths (the seeded init finds them), not nn.Linear's."""
    config = transformers.AutoConfig.for_model(**QWEN3)
    torch.manual_seed(0)
    plain = HFCausalLM(config)
    plain.materialize()
    torch.manual_seed(0)
    converted = HFCausalLM(config)
    convert(converted.model, Float8Settings(), CPU)
    converted.materialize()
    want, got = plain.state_dict(), converted.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_the_planner_counts_the_experts_in_fp8_only_where_they_run_in_fp8():
    """A Mixtral's routed experts count as fp8 FLOPs on the devices where the runtime gives them the float8 grouped
    GEMM (H100, H200: CUDA 9.0+), as bf16 elsewhere (MI300X: ROCm, bf16 here); worked out by hand."""
    fields = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "num_local_experts": 4,
              "num_experts_per_tok": 2, "max_position_embeddings": 128}  # fmt: skip
    shape = from_hf_config(fields)
    # per layer: attention q 64x64, k 32x64, v 32x64, o 64x64 (12,288); router 4x64 (256); each expert gate/up
    # 128x64 and down 64x128 (24,576), 2 of 4 per token; 2 norms of 64. Active: head 32,768 + 2 x 61,824
    assert shape.active_params() == 32_768 + 2 * (12_288 + 256 + 2 * 24_576 + 128)
    counted = 2 * 156_416 + 128 * 4 * 32 * 2  # 2 x active + causal attention (seq 128): 345,600 per token
    h100, mi300x = get_device("h100"), get_device("mi300x")
    assert converted_kinds(shape, h100) == {"attention", "mlp", "expert"}
    assert converted_kinds(shape, mi300x) == converted_kinds(shape) == {"attention", "mlp"}
    attention = 2 * 12_288 * 2  # fp8 FLOPs per token: attention's, 2 layers
    assert fp8_flop_share(shape, 128, mi300x) == pytest.approx(attention / counted)
    assert fp8_flop_share(shape, 128, h100) == pytest.approx((attention + 2 * 2 * 24_576 * 2) / counted)
    work = Workload(128, 8, precision="fp8")
    for device in (h100, mi300x):
        rank = _Rank(shape, Cluster(2, 8, device), Layout(dp=2), work)
        fast = rank.gemm(4096, 4096, 4096, kind="expert") < rank.gemm(4096, 4096, 4096)
        assert fast == (device is h100)  # the experts' matmuls at the fp8 peak on the H100 only
        est = evaluate(shape, Cluster(2, 8, device), Layout(dp=2), work)
        assert est.counts["fp8_flop_share"] == fp8_flop_share(shape, 128, device)
    # an expert width that is no multiple of 16 keeps the experts in bf16 on the H100 too
    assert converted_kinds(from_hf_config({**fields, "intermediate_size": 120}), h100) == {"attention"}


def test_hf_experts_it_does_not_handle_keep_hf_forward():
    """Experts with biases or transposed weights (GPT-OSS's layout) keep HF's forward, and the report says so."""
    experts = build("mixtral").model.layers[0].mlp.experts
    experts.has_bias = True
    cls = type(experts)
    assert float8_experts._convert_one(experts, BF16, "test").startswith("HF's own forward (has_bias)")
    assert type(experts) is cls
