"""pp_balance="profile": per-layer times on a sample microbatch give the stages; the split balances measured
stage times, leaves the model untouched, and trains like one process."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from conftest import PARITY_CASES, launch
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from omegaconf import OmegaConf
from parity import assert_same_losses, assert_same_params

import lightning_parallel  # noqa: F401
from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.models import GPTConfig, GPTModule
from lightning_parallel.models.gpt import RecipeGPT
from lightning_parallel.models.lit_vgg import LitVGG
from lightning_parallel.models.vgg import VGGConfig
from lightning_parallel.parallel.data.stages import stage_sharding
from lightning_parallel.parallel.pipeline.partition import uniform_partition
from lightning_parallel.parallel.pipeline.profile import profile_layers, profiled_partition

REPO = Path(__file__).resolve().parents[1]
TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=8, d_model=32)


def test_vgg16_profiled_split_is_the_best_split_of_its_profile():
    """VGG16 (the recipe's config: 14 pipeline layers) into pp=4 stages: by the profile's own layer times, the
    profiled split's slowest stage is the least any of the 286 contiguous splits reaches, and no slower than
    the uniform split's. How the split fares re-timed stage by stage is a speed question, measured by
    `make bench` (BENCHMARKS.md, "Profile-guided pipeline split"), not asserted here."""
    model_conf = OmegaConf.load(REPO / "conf/model/vgg16.yaml")
    module = LitVGG(config=VGGConfig(name=model_conf.name, width=model_conf.width))
    layers = module.pipeline_layers()
    assert len(layers) == 14
    profile = profile_layers(layers, module.example_input_array, warmup=0, repeats=1)
    split = profiled_partition(profile, 4)
    times = profile.times

    def slowest(stages: list[range]) -> float:
        return max(sum(times[i] for i in stage) for stage in stages)

    every = [[range(a, b) for a, b in zip((0, *cuts), (*cuts, 14))] for cuts in itertools.combinations(range(1, 14), 3)]
    assert len(every) == 286
    assert slowest(split.stages) == pytest.approx(min(slowest(stages) for stages in every))
    assert slowest(split.stages) <= slowest(uniform_partition(14, 4))
    assert split.stage_seconds == pytest.approx([sum(times[i] for i in stage) for stage in split.stages])


def test_profiling_leaves_model_and_random_state_alone():
    """Timed on copies: weights, BatchNorm statistics, gradients and the RNG are as before; a model on the
    meta device gets the same per-layer memory as a real one."""
    module = LitVGG(config=VGGConfig(name="vgg11", width=8))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.get_rng_state()
    real = profile_layers(module.pipeline_layers(), module.example_input_array, warmup=0, repeats=1)
    assert torch.equal(rng, torch.get_rng_state())
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), f"profiling changed {key}"
    assert all(p.grad is None for p in module.parameters())
    with torch.device("meta"):
        meta_gpt = RecipeGPT(TINY)
    gpt = RecipeGPT(TINY)
    example = GPTModule(config=TINY).example_input_array
    on_meta = profile_layers(meta_gpt.layers(), example, warmup=0, repeats=1)
    on_cpu = profile_layers(gpt.layers(), example, warmup=0, repeats=1)
    assert all(p.is_meta for p in meta_gpt.parameters())
    assert on_meta.param_bytes == on_cpu.param_bytes == [sum(p.nbytes for p in m.parameters()) for m in gpt.layers()]
    assert on_meta.activation_bytes == on_cpu.activation_bytes
    assert all(t > 0 for t in real.times + on_meta.times)


def test_memory_budget_constrains_the_profiled_split():
    """With a budget, the split is the fastest among those whose stages fit (brute force over the cuts, bytes
    recomputed from the profile: 4x parameter bytes plus activations times in-flight microbatches); a budget
    below the least any split needs fails naming the setting and that least."""
    gpt = RecipeGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=8, d_model=32))
    profile = profile_layers(gpt.layers(), GPTModule(config=TINY).example_input_array, warmup=0, repeats=1)
    in_flight, n = [8, 1], len(gpt.layers())  # the first stage holds 8 microbatches' activations

    def held(stage: int, layers: range) -> int:
        return sum(4 * profile.param_bytes[i] + in_flight[stage] * profile.activation_bytes[i] for i in layers)

    splits = [[range(0, c), range(c, n)] for c in range(1, n)]
    least = min(max(held(s, r) for s, r in enumerate(split)) for split in splits)
    free = profiled_partition(profile, 2, in_flight=in_flight)
    for budget in (least, (least + max(held(s, r) for s, r in enumerate(free.stages))) // 2):
        fitting = [split for split in splits if all(held(s, r) <= budget for s, r in enumerate(split))]
        fastest = min(max(sum(profile.times[i] for i in r) for r in split) for split in fitting)
        got = profiled_partition(profile, 2, budget=budget, in_flight=in_flight)
        assert got.stage_bytes == [held(s, r) for s, r in enumerate(got.stages)]
        assert max(got.stage_bytes) <= budget
        assert max(got.stage_seconds) == pytest.approx(fastest)
    with pytest.raises(
        ValueError,
        match=rf"pp_memory_budget={int(least) - 1} bytes per stage fits no split .* fits is {int(least)} bytes",
    ):
        profiled_partition(profile, 2, budget=least - 1, in_flight=in_flight)


def test_state_bytes_follow_zero_and_tp():
    p = 100
    assert stage_sharding(0).state_bytes(p, dp=1) == 4 * p  # parameters, gradients, two optimizer states
    assert stage_sharding(1).state_bytes(p, dp=2) == 3 * p
    assert stage_sharding(2).state_bytes(p, dp=2) == 2.5 * p
    assert stage_sharding(3).state_bytes(p, dp=4) / 2 == p / 2  # tp=2 halves what a rank holds


def test_memory_budget_setting_is_checked():
    with pytest.raises(ValueError, match=r"pp_memory_budget=-1 is not a byte count: set it to a positive number"):
        Hybrid3DStrategy(pp=2, pp_balance="profile", pp_memory_budget=-1)
    with pytest.warns(UserWarning, match=r"pp_memory_budget only applies with pp_balance='profile'"):
        Hybrid3DStrategy(pp=2, pp_memory_budget=10**9)


def test_a_model_without_example_input_fails_before_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Lightning's launcher started worker processes before the model was checked")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", refuse)
    model = GPTModule(config=TINY)
    model.example_input_array = None
    trainer = pl.Trainer(
        strategy=Hybrid3DStrategy(pp=2, pp_balance="profile"), accelerator="cpu", devices=2, logger=False
    )
    with pytest.raises(TypeError, match=r"GPTModule.example_input_array has none: set self.example_input_array"):
        trainer.fit(model)
    assert not dist.is_initialized()


def test_profiled_pipeline_trains_like_one_process(reference, tmp_path_factory):
    """pp=2 with the profiled split (built in __init__, then on the meta device) matches the single process;
    rank 0 logs the split."""
    cases = [{**PARITY_CASES[0], "meta": True}, PARITY_CASES[1]]
    run = launch(tmp_path_factory, "hybrid3d:pp=2,pp_balance=profile", 2, cases)
    for case in cases:
        name = case["name"]
        assert run.case(name, 0)["losses"] == run.case(name, 1)["losses"], f"{name}: ranks disagree"
        assert_same_losses(run.losses(name, [0]), reference.losses(name), f"profile {name}")
        assert_same_params(run.params(name), reference.params(name), f"profile {name}")
    assert run.case("plain")["built_on"] == "meta"
    log = (run.out / "rank0.log").read_text()
    lines = re.findall(r"pp_balance='profile': layers per stage .*", log)
    assert len(lines) == len(cases), log[-3000:]
    assert re.search(r"0-\d: [\d.e+-]+ ms, \d-3: [\d.e+-]+ ms", lines[0]), lines[0]
