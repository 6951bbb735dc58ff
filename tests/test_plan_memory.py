"""The planners' memory per rank against what recipe runs measure, for the axes and options past the table of
tests/test_plan.py: context parallelism (ring, Ulysses), expert parallelism, HSDP, tp with sequence parallelism
and activation checkpointing (selective, full). Every run 3 steps of the GPT recipe; one launch per world size
(conftest's Batch). Measured: ``model_state_bytes`` + ``activation_memory_bytes`` of each rank (what the forward
leaves for backward, so the analytic planner's figure is taken without the layer a full checkpoint rebuilds)."""

from __future__ import annotations

import pytest
from conftest import Batch

from lightning_parallel.parallel.data.stages import stage_sharding
from lightning_parallel.parallel.pipeline.partition import uniform_partition
from lightning_parallel.plan import gpt_spec, load_model_config
from lightning_parallel.planning.analytic import evaluate
from lightning_parallel.planning.cluster import Cluster, get_device
from lightning_parallel.planning.estimate import LayerCost, Settings, all_reduce_bytes, estimate_layout
from lightning_parallel.planning.hf_config import from_recipe
from lightning_parallel.planning.layout import Layout, Workload
from lightning_parallel.planning.profile import layer_costs

TOLERANCE = 0.15
# a dropless MoE pads each expert to its busiest one's tokens, so activations follow the routing (the profile's
# routing at initialization is not the run's at step 3): the states are asserted exact, the total within 40%
MOE_TOLERANCE = 0.40
COMMON = ["trainer.max_steps=3", "trainer.logger=none", "trainer.enable_progress_bar=false", "sample_tokens=0"]
# label -> (world size, model, strategy overrides, data.global_batch_size)
RUNS = {
    "ac_full": (2, "gpt_tiny", ["strategy.activation_checkpointing=full"], 32),
    "ac_selective": (2, "gpt_tiny", ["strategy.activation_checkpointing=selective"], 32),
    "tp2_sp": (2, "gpt_tiny", ["strategy.tp=2", "strategy.tensor.sequence_parallel=true"], 32),
    "cp2_ring": (2, "gpt_long", ["strategy.cp=2"], 4),
    "cp2_ulysses": (2, "gpt_long", ["strategy.cp=2", "strategy.context.mode=ulysses"], 4),
    "ep2": (2, "gpt_moe_tiny", ["strategy.ep=2"], 32),
    "hsdp": (4, "gpt_tiny", ["strategy.zero_stage=3", "strategy.dp_shard=2"], 32),
    "dp2_tp2_sp": (4, "gpt_tiny", ["strategy.tp=2", "strategy.tensor.sequence_parallel=true"], 32),
    "cp2_dp2": (4, "gpt_long", ["strategy.cp=2"], 4),
    "ep2_dp4": (4, "gpt_moe_tiny", ["strategy.ep=2", "strategy.zero_stage=1"], 32),
    "pp2_ac_full": (2, "gpt_tiny", ["strategy.pp=2", "strategy.activation_checkpointing=full"], 32),
    "tp2_sp_ac_selective": (
        2,
        "gpt_tiny",
        ["strategy.tp=2", "strategy.tensor.sequence_parallel=true", "strategy.activation_checkpointing=selective"],
        32,
    ),
    "cp2_dp2_zero3": (4, "gpt_long", ["strategy.cp=2", "strategy.zero_stage=3"], 4),
}
# the runs the analytic planner models as this package runs them; not: torch's sequence parallelism keeps the
# gathered inputs of the column-parallel linears (the analytic formula, Megatron's, gathers them again in
# backward), selective checkpointing here is torchtitan's op-level policy (the analytic one recomputes the
# attention core only, Korthikanti et al.), and MoE activations follow the routing
ANALYTIC = ("ac_full", "cp2_ring", "cp2_ulysses", "hsdp", "cp2_dp2", "cp2_dp2_zero3")


def _case(world: int, model: str, overrides: list[str], batch: int) -> dict:
    settings = [f"model={model}", f"data.global_batch_size={batch}", "strategy=hybrid3d", *COMMON, *overrides]
    return {"recipe": "gpt", "overrides": [f"trainer.devices={world}", *settings]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    spec = {label: (run[0], "", [_case(*run)]) for label, run in RUNS.items()}
    return Batch(tmp_path_factory, spec, tag="memory", worker="plan")


def estimates(label: str, layout: dict) -> tuple[list[tuple[float, float]], tuple[float, float]]:
    """((model states, activations) of each pp rank from the profiling planner, the same for the first pp rank
    from the analytic planner) for one run's reported layout (metrics.json's ``layout``)."""
    world, model, overrides, batch = RUNS[label]
    mode = next((o.split("=")[1] for o in overrides if "activation_checkpointing" in o), "none")
    sp = "strategy.tensor.sequence_parallel=true" in overrides
    shard = layout["dp_shard"] if layout["dp_shard"] != layout["dp"] else None
    _, m = load_model_config(model)
    costs = layer_costs(gpt_spec(m), layout["tp"], "32-true", mode)
    s = Settings(global_batch=batch, activation_checkpointing=mode)
    pp, degrees = layout["pp"], {"cp": layout["cp"], "dp_shard": shard, "sequence_parallel": sp}
    dims, stages = (pp, layout["dp"], layout["tp"]), uniform_partition(len(costs), pp)
    est = estimate_layout(costs, stages, list(range(pp)), dims, layout["zero_stage"], s, layout["ep"], **degrees)
    x = Layout(
        **{k: layout[k] for k in ("tp", "pp", "dp", "ep", "zero_stage")},
        **degrees,
        activation_checkpointing=mode,
        cp_mode=layout["cp_mode"] or "ring",
        microbatches=2 * pp if pp > 1 else 1,  # the strategy's default
    )
    a = evaluate(from_recipe(m, model), Cluster(world, 8, get_device("h100")), x, Workload(m.seq_len, batch, "32-true"))
    profiled = list(zip(est.model_state_per_rank, est.activation_per_rank))
    return profiled, (a.states, a.activations - a.recompute)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(RUNS))
def test_memory_estimates_against_measured(label, runs):
    ranks = [r[0] for r in runs[label].ranks]
    layout = ranks[0]["layout"]
    per_pp_rank, analytic = estimates(label, layout)
    profiled = [per_pp_rank[rank // (layout["world_size"] // layout["pp"])] for rank in range(len(ranks))]
    rows = []
    for rank, r in enumerate(ranks):
        measured = r["model_state"] + r["activation"]
        errors = [sum(est) / measured - 1 for est in (profiled[rank], analytic)]
        rows.append(
            f"{label} rank {rank}: measured {r['model_state']} + {r['activation']} = {measured}; profile "
            f"{profiled[rank][0]:.0f} + {profiled[rank][1]:.0f} ({errors[0]:+.1%}); analytic {analytic[0]:.0f} + "
            f"{analytic[1]:.0f} ({errors[1]:+.1%})"
        )
    print("\n" + "\n".join(rows))
    moe = RUNS[label][1] == "gpt_moe_tiny"
    for rank, r in enumerate(ranks):
        measured = r["model_state"] + r["activation"]
        assert r["model_state"] == profiled[rank][0], rows[rank]
        assert abs(sum(profiled[rank]) - measured) <= (MOE_TOLERANCE if moe else TOLERANCE) * measured, rows[rank]
        if label in ANALYTIC:
            assert abs(sum(analytic) - measured) <= TOLERANCE * measured, rows[rank]


# ----- the estimate's new degrees by hand (single process) -----


def test_cp_hsdp_and_sequence_parallel_by_hand():
    # two layers of 1000 parameters; 100 bytes per sample kept, 40 of them norm inputs; no loss bytes
    costs = [LayerCost({f"w{i}": 1000}, 0, 100, norm_in_per_sample=40) for i in range(2)]
    s = Settings(global_batch=16)
    plain = estimate_layout(costs, [range(2)], [0], (1, 4, 1), 3, s)
    assert plain.model_state_per_rank == [16 * 2000 // 4] and plain.activation_per_rank == [2 * 100 * 4]
    # HSDP: ZeRO-3 shards over the 2 ranks of a replica; cp=2 halves every sample's tokens and shards over dp x cp
    hsdp = estimate_layout(costs, [range(2)], [0], (1, 4, 1), 3, s, dp_shard=2)
    assert hsdp.model_state_per_rank == [16 * 2000 // 2]
    # a reduce-scatter and gathers inside the replica of the 8000 bytes, the 4000-byte shard all-reduced over 2
    assert hsdp.comm["dp"] == pytest.approx(stage_sharding(3).comm_bytes(8000, 2) + all_reduce_bytes(4000, 2))
    cp = estimate_layout(costs, [range(2)], [0], (1, 4, 1), 3, s, cp=2)
    assert cp.model_state_per_rank == [16 * 2000 // 8] and cp.activation_per_rank == [2 * 100 * 2]
    # sequence parallelism: the norm inputs split over tp=2; not counted again under checkpointing
    sp = estimate_layout(costs, [range(2)], [0], (1, 2, 2), 0, s, sequence_parallel=True)
    assert sp.activation_per_rank == [2 * (100 - 40 / 2) * 8]
    full = Settings(global_batch=16, activation_checkpointing="full")
    assert estimate_layout(costs, [range(2)], [0], (1, 2, 2), 0, full, sequence_parallel=True).activation_per_rank == [
        2 * 100 * 8
    ]


def test_profile_measures_checkpointed_layers_and_norm_inputs():
    """gpt_tiny at micro-batch size 1: full checkpointing keeps each layer's output only (64 tokens x 64 fp32
    features per block), and the norm inputs of a block are its two LayerNorms' (the same size each)."""
    _, m = load_model_config("gpt_tiny")
    spec = gpt_spec(m)
    plain, full = layer_costs(spec, 1), layer_costs(spec, 1, activation_checkpointing="full")
    hidden = m.seq_len * m.d_model * 4
    assert [c.act_per_sample for c in full[:-1]] == [hidden] * (len(full) - 1)
    assert plain[1].norm_in_per_sample == 2 * hidden and plain[1].act_per_sample > 5 * hidden
    selective = layer_costs(spec, 1, activation_checkpointing="selective")
    assert full[1].act_per_sample < selective[1].act_per_sample < plain[1].act_per_sample
