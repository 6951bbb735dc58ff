"""The planner with LoRA adapters (``--lora-rank``), without any process group: model states are the frozen base's
bytes (sharded over dp under ZeRO-3 only, split by tp and pp) plus the adapters' 16 bytes per parameter (sharded
as the ZeRO stage shards them); adapters counted from the model config, per tp rank."""

from __future__ import annotations

import json

import pytest
import torch
from test_plan import paper_bytes

from lightning_parallel.plan import gpt_spec, load_model_config, main, make_plan, parse_args
from lightning_parallel.planning.adapters import adapter_comm_bytes, adapter_model_state_bytes
from lightning_parallel.planning.estimate import LayerCost, Settings, estimate_layout
from lightning_parallel.planning.profile import layer_costs

# ----- the formula -----


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_adapters_are_fp32_adam_under_zero_and_the_base_is_its_parameters(stage, dp):
    base = 1000 * 2 // (dp if stage == 3 else 1)  # bf16, no gradient and no optimizer state
    got = adapter_model_state_bytes(1000, 100, zero_stage=stage, dp=dp, tp=1, pp=1, base_bytes_per_param=2)
    assert got == base + paper_bytes(stage, 100, dp)


def test_tp_and_pp_split_base_and_adapters_and_the_shards_round_up():
    # 1000 base and 96 adapter elements over tp=2 x pp=2: 250 and 24 a rank; ZeRO-3 over dp=3 pads both (by
    # elements: FSDP2 and the flat buffers pad a tensor's elements, not its bytes)
    got = adapter_model_state_bytes(1000, 96, zero_stage=3, dp=3, tp=2, pp=2, base_bytes_per_param=4)
    assert got == -(-250 // 3) * 4 + -(-24 * 16 // 3)
    assert adapter_model_state_bytes(1000, 96, zero_stage=0, dp=3, tp=2, pp=2, base_bytes_per_param=4) == 1000 + 384


def test_dp_traffic_is_the_adapters_gradients_plus_zero3_gathering_the_base():
    grads = 100 * 4  # fp32 adapter gradients
    ring = 2 * grads * 3 / 4  # one all-reduce's bytes per rank at dp=4
    assert adapter_comm_bytes(8000, 100, zero_stage=0, dp=4) == pytest.approx(ring)
    assert adapter_comm_bytes(8000, 100, zero_stage=1, dp=4) == pytest.approx(1.5 * ring)
    assert adapter_comm_bytes(8000, 100, zero_stage=3, dp=4) == pytest.approx(1.5 * ring + 2 * 8000 * 3 / 4)
    assert adapter_comm_bytes(8000, 100, zero_stage=3, dp=1) == 0.0


def test_estimate_layout_by_hand_with_adapters():
    """Two layers on pp=2, dp=2, ZeRO-3: each rank's states are its layer's base halved plus its adapters."""
    costs = [LayerCost(params={"a": 400}, adapter_params=40), LayerCost(params={"b": 600}, adapter_params=60)]
    s = Settings(global_batch=8, precision="bf16-mixed", base_bytes_per_param=2)
    est = estimate_layout(costs, [range(0, 1), range(1, 2)], [0, 1], (2, 2, 1), 3, s)
    assert est.model_state_per_rank == [400 * 2 / 2 + 40 * 16 / 2, 600 * 2 / 2 + 60 * 16 / 2]
    full = estimate_layout(
        [LayerCost(params=c.params) for c in costs], [range(0, 1), range(1, 2)], [0, 1], (2, 2, 1), 3, s
    )
    assert est.comm["dp"] < full.comm["dp"]  # the gradient reduction shrinks to the adapters


# ----- counting adapters from the model config -----


def gpt_adapters(m, r: int, tp: int) -> int:
    """Adapters per tp rank on q, k, v, proj (d x d) and fc, proj (d x 4d) of every block: r x (in + out) each,
    the split side divided by tp (column-parallel: out; row-parallel: in)."""
    d, h = m.d_model, m.mlp_ratio * m.d_model
    attention = 3 * r * (d + d // tp) + r * (d // tp + d)
    mlp = r * (d + h // tp) + r * (h // tp + d)
    return m.n_layer * (attention + mlp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_adapters_are_counted_per_tp_rank_from_the_config(tp):
    _, m = load_model_config("gpt_tiny")
    costs = layer_costs(gpt_spec(m, lora_rank=8), tp)
    assert sum(c.adapter_params for c in costs) == gpt_adapters(m, 8, tp)
    assert costs[0].adapter_params == 0 and costs[-1].adapter_params == 0  # no adapters on the embedding or head


def test_moe_blocks_adapt_attention_and_the_shared_expert_not_the_router_or_experts():
    _, m = load_model_config("gpt_moe_tiny")
    m.moe_shared_hidden = 32  # a shared expert: two linears beside the routed experts
    spec = gpt_spec(m, lora_rank=4)
    linears = {n: mod for n, mod in spec.model.named_modules() if isinstance(mod, torch.nn.Linear)}
    assert any(n.endswith(".mlp.router") for n in linears) and any(".mlp.shared." in n for n in linears)
    adapted = [mod for n, mod in linears.items() if n.startswith("blocks.") and not n.endswith(".router")]
    want = sum(4 * (mod.in_features + mod.out_features) for mod in adapted)
    assert sum(c.adapter_params for c in layer_costs(spec, 1)) == want > 0


def test_plan_with_lora_holds_the_formula_and_less_than_full_fine_tuning():
    args = ["gpt_tiny", "--world-size", "4", "--device-memory", "1GB"]
    full = make_plan(parse_args(args))
    lora = make_plan(parse_args([*args, "--lora-rank", "8", "--lora-base-dtype", "bfloat16"]))
    _, m = load_model_config("gpt_tiny")
    assert lora["adapter_params"] == gpt_adapters(m, 8, 1) and lora["num_params"] == full["num_params"]
    rows = {(r["pp"], r["dp"], r["tp"], r["zero_stage"]): r for r in lora["layouts"] if r["zero_stage"] is not None}
    z3 = rows[(1, 4, 1, 3)]  # pp=1, tp=1: one rank holds the whole model
    want = adapter_model_state_bytes(
        full["num_params"], gpt_adapters(m, 8, 1), zero_stage=3, dp=4, tp=1, pp=1, base_bytes_per_param=2
    )
    assert z3["model_state_per_rank"] == [want]
    for r in full["layouts"]:
        if r["zero_stage"] is not None:
            twin = rows[(r["pp"], r["dp"], r["tp"], r["zero_stage"])]
            assert max(twin["model_state_per_rank"]) < max(r["model_state_per_rank"]), twin


def test_cli_prints_lora_and_refuses_bad_lora_input(capsys):
    assert main(["gpt_tiny", "--world-size", "2", "--device-memory", "1GB", "--lora-rank", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lora_rank"] == 4
    assert main(["gpt_tiny", "--world-size", "2", "--device-memory", "1GB", "--lora-rank", "4"]) == 0
    assert "LoRA rank 4:" in capsys.readouterr().out
    for extra, message in [
        (["--lora-rank", "-1"], "--lora-rank=-1 is not a rank"),
        (["--lora-base-dtype", "bfloat16"], "--lora-base-dtype=bfloat16 is the frozen base's dtype: add --lora-rank"),
    ]:
        assert main(["gpt_tiny", "--world-size", "2", "--device-memory", "1GB", *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["vgg11", "--world-size", "2", "--device-memory", "1GB", "--lora-rank", "4"]) == 2
    assert "vgg11 (a vgg) has none: drop --lora-rank" in capsys.readouterr().err
