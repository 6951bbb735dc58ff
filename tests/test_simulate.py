"""The simulator (lightning_parallel/simulate) held against real runs: at world 2, each simulated rank's model-state
bytes and its last step's collectives (operation, mesh axes, dtype, shape, bytes, group) equal those of a real gloo
run of the same layout (tests/workers/cases/simulate_ref.py, a Fabric loop stepping as the simulator steps); the
consistency check finds a rank whose sequence parts from its group's; the rank choice and the settings' refusals."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from harness import run_worker
from workers.cases.common import TINY

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.simulate import default_ranks, simulate
from lightning_parallel.simulate.trace import Collective, check_consistency

STEPS, BATCH = 2, 4
MOE = dataclasses.replace(TINY, moe_experts=4, moe_top_k=2, moe_every=2)  # block 1's FFN: 4 experts, top-2
# label -> (world, the worker's strategy spec, the same layout for the simulator)
FAST = {
    "zero2": (2, "zero2", {"zero_stage": 2}),
    "tp2_sp": (2, "hybrid3d:tp=2,sequence_parallel=1", {"tp": 2, "sequence_parallel": True}),
    "pp2_1f1b": (2, "hybrid3d:pp=2,pp_schedule=1f1b", {"pp": 2, "pp_schedule": "1f1b"}),
}
SLOW = {
    "zero1": (2, "zero1", {"zero_stage": 1}),
    "zero3": (2, "zero3", {"zero_stage": 3}),
    "hsdp": (4, "hybrid3d:zero_stage=3,dp_shard=2", {"zero_stage": 3, "dp_shard": 2}),
    "cp2_ring": (2, "hybrid3d:cp=2", {"cp": 2}),
    "pp2_gpipe": (2, "hybrid3d:pp=2,pp_schedule=gpipe", {"pp": 2, "pp_schedule": "gpipe"}),
    "pp2_interleaved": (
        2,
        "hybrid3d:pp=2,pp_schedule=interleaved_1f1b",
        {"pp": 2, "pp_schedule": "interleaved_1f1b"},
    ),
    "pp2_tp2_zero1": (
        4,
        "hybrid3d:pp=2,tp=2,zero_stage=1,sequence_parallel=1",
        {"pp": 2, "tp": 2, "zero_stage": 1, "sequence_parallel": True},
    ),
    "tp2_zero3": (
        4,
        "hybrid3d:tp=2,zero_stage=3,sequence_parallel=1",
        {"tp": 2, "zero_stage": 3, "sequence_parallel": True},
    ),
}


def _comparable(c: dict) -> tuple:
    return (c["op"], c["axes"], c["dtype"], tuple(c["shape"]), c["payload_bytes"], c["group_size"], c["step"])


def _routed(c: dict) -> tuple:
    """As :func:`_comparable`, but the routed rows' all-to-alls (floating point: the tokens out, the experts'
    outputs back) without their shape and bytes: the real router's, uneven, against the simulator's uniform one."""
    if c["op"] == "all_to_all" and c["dtype"].startswith(("float", "bfloat")):
        return (c["op"], c["axes"], c["dtype"], c["group_size"], c["step"])
    return _comparable(c)


@pytest.mark.parametrize("label", list(FAST))
def test_simulated_ranks_equal_a_gloo_run(label, tmp_path):
    _check_against_gloo(*FAST[label], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_more_layouts_equal_a_gloo_run(label, tmp_path):
    _check_against_gloo(*SLOW[label], tmp_path)


@pytest.mark.slow
def test_expert_parallel_ranks_equal_a_gloo_run_but_for_the_routed_rows(tmp_path):
    """ep=2: model states equal; the same ops in the same order, the counts' all-to-all and every other op with
    their shapes and bytes; the routed rows' all-to-alls by operation, axes, dtype and group (routing is uniform
    in the simulator)."""
    _check_against_gloo(2, "hybrid3d:ep=2", {"ep": 2}, tmp_path, MOE, _routed)


# a tiny Llama (GQA, gated MLP) for LoRA: peft's adapters on its 7 linear layers per block, rank 4
LLAMA = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 16,
}  # fmt: skip
# label -> (world, the worker's strategy spec, the layout, the frozen base's dtype)
LORA = {
    "lora_zero2": (2, "zero2", {"zero_stage": 2}, None),
    "lora_tp2_sp_bf16_base": (2, "hybrid3d:tp=2,sequence_parallel=1", {"tp": 2, "sequence_parallel": True}, "bfloat16"),
    "lora_zero3": (2, "zero3", {"zero_stage": 3}, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LORA))
def test_lora_ranks_equal_a_gloo_run(label, tmp_path):
    """LoRA (rank 4, every linear layer but the head) on a frozen base: the simulated rank holds the frozen base's
    shard, the adapters' gradients and AdamW states only, and issues the real run's collectives."""
    world, spec, layout, base_dtype = LORA[label]
    lora = {"llama": LLAMA, "rank": 4, "seq_len": 16, "base_dtype": base_dtype}
    sim_kw = {"lora_rank": 4, "lora_base_dtype": base_dtype, "seq_len": 16}
    sim = _check_against_gloo(world, spec, layout, tmp_path, _llama(), case={"hf_lora": lora}, sim_kw=sim_kw)
    for r in sim.ranks:  # adapters train, the base is held: gradients and AdamW's states are the adapters' only
        states = r.model_state_bytes
        assert 0 < states["optimizer"] == 2 * states["grads"] and 2 * states["grads"] < states["params"]


def _llama():
    import transformers

    return transformers.LlamaConfig(**LLAMA)


def _check_against_gloo(
    world: int, spec: str, layout: dict, tmp_path, model=TINY, comparable=_comparable, case=None, sim_kw=None
) -> Any:
    case = {"steps": STEPS, "global_batch": BATCH, **(case or {})}
    if isinstance(model, type(TINY)) and model is not TINY:
        case["gpt"] = dataclasses.asdict(model)
    real = run_worker("simulate_ref", world, ["--strategy", spec, "--opts", json.dumps(case)], tmp_path, timeout=600)
    ranks = list(range(world))
    kw = {"precision": "32-true", "global_batch_size": BATCH, "steps": STEPS, "ranks": ranks, **(sim_kw or {})}
    sim = simulate(model, world, layout, **kw)
    assert [r.rank for r in sim.ranks] == ranks
    for rank, (mine, theirs) in enumerate(zip(sim.ranks, real)):
        assert mine.model_state_bytes == theirs["model_state_bytes"], f"rank {rank}"
        simulated = [comparable(c.to_dict()) for c in mine.collectives]
        assert simulated == [comparable(c) for c in theirs["collectives"]], f"rank {rank}"
        assert simulated, "a layout that communicates recorded no collective"
    assert not sim.mismatches and sim.groups_compared >= 1
    return sim


def _op(op: str, shape: tuple[int, ...], ranks=(0, 1), step=0) -> Collective:
    return Collective(op, "dp", "float32", shape, 16, 8.0, len(ranks), ranks, 1, step)


def test_consistency_names_the_group_and_first_differing_op():
    same = [_op("all_gather", (4,)), _op("reduce_scatter", (8,))]
    mismatches, compared = check_consistency({0: same, 1: list(same)})
    assert (mismatches, compared) == ([], 1)
    mismatches, _ = check_consistency({0: same, 1: [same[0], _op("reduce_scatter", (6,))]})
    assert len(mismatches) == 1 and mismatches[0].index == 1
    assert "op #1" in mismatches[0].describe() and "rank 1" in mismatches[0].describe()
    mismatches, _ = check_consistency({0: same, 1: same[:1]})  # rank 1 never joins the second op
    assert mismatches[0].index == 1 and mismatches[0].second_op is None


def test_consistency_pairs_each_send_with_its_receive():
    def p2p(op: str, shape: tuple[int, ...], peer: int) -> Collective:
        return Collective(op, "pp", "float32", shape, 16, 16.0, 2, (0, 1), 1, 0, peer)

    sends = [p2p("send", (1, 4), 1), p2p("recv", (1, 4), 1)]
    mismatches, compared = check_consistency({0: sends, 1: [p2p("recv", (1, 4), 0), p2p("send", (1, 4), 0)]})
    assert (mismatches, compared) == ([], 2)  # 0 -> 1 and 1 -> 0
    mismatches, _ = check_consistency({0: sends, 1: [p2p("recv", (1, 8), 0), p2p("send", (1, 4), 0)]})
    assert len(mismatches) == 1 and mismatches[0].first_op[1] == (1, 4) and mismatches[0].second_op[1] == (1, 8)


def test_default_ranks_cover_every_axis_and_the_last_rank():
    dims = ParallelConfig(tp=8, pp=4).validate().dims(256)
    # rank 0, the last tp rank, the last dp rank (stride 8), a middle and the last pp stage (stride 64), the last
    assert default_ranks(dims) == [0, 7, 56, 128, 192, 255]


def test_bad_settings_are_refused_before_any_rank_runs():
    with pytest.raises(ValueError, match="no ParallelConfig setting"):
        simulate(TINY, 2, "tensor=2")
    with pytest.raises(ValueError, match="global-batch-size=3"):
        simulate(TINY, 2, "zero_stage=1", global_batch_size=3)
    with pytest.raises(ValueError, match="precision"):
        simulate(TINY, 2, "zero_stage=1", precision="fp8")


def test_a_pipeline_batch_that_does_not_split_into_microbatches_is_refused():
    with pytest.raises(ValueError, match="do not split into microbatches=4"):
        simulate(TINY, 2, "pp=2", global_batch_size=2)
    with pytest.raises(ValueError, match="zero-bubble schedules"):
        simulate(TINY, 2, "pp=2,pp_schedule=zero_bubble")


def test_fp16_and_misplaced_lora_settings_are_refused_by_name(capsys):
    """16-mixed by name with its reason (the loss scaler's host read) and the fix (bf16-mixed), from the API and the
    command line; LoRA on a model the simulator puts no adapters on, or a base dtype without adapters."""
    from lightning_parallel.simulate.__main__ import main

    with pytest.raises(ValueError, match=r"16-mixed is not simulated: its loss scaler .* Simulate --precision bf16"):
        simulate(TINY, 2, "zero_stage=2", precision="16-mixed")
    assert main(["gpt_tiny", "--gpus", "2", "--precision", "16-mixed"]) == 2
    assert "found_inf.item()" in capsys.readouterr().err
    with pytest.raises(ValueError, match="lora-rank=4: gpt is a recipe GPT, and the simulator puts LoRA adapters on"):
        simulate(TINY, 2, "zero_stage=2", lora_rank=4)
    with pytest.raises(ValueError, match="lora-base-dtype=bfloat16 is the frozen base's dtype: add --lora-rank"):
        simulate(TINY, 2, "zero_stage=2", lora_base_dtype="bfloat16")
