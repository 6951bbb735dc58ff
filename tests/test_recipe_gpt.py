"""recipes/train_gpt.py end to end: the default command, and the same training under other layouts."""

from __future__ import annotations

import csv
import json

import pytest
from recipe_runs import GPT, assert_fails_before_workers, default_run_metrics, run
from recipe_runs import run_recipe as _run_recipe
from test_recipe_configs import compose_gpt

SHORT = ["trainer=debug", "trainer.max_steps=6", "sample_tokens=8"]


def run_recipe(cwd, *overrides: str, timeout: int = 300) -> dict:
    return _run_recipe(GPT, cwd, *overrides, timeout=timeout)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_recipe(tmp_path_factory.mktemp("single"), *SHORT)


def test_single_process_run_writes_its_metrics(single):
    assert single["steps"] == 6 and single["layout"]["world_size"] == 1
    assert single["final_train_loss"] < 5.6  # below a uniform guess over 256 bytes (ln 256 = 5.55)
    assert single["final_val_loss"] is not None and single["throughput"] > 0
    # the steady rate (setup, sanity checks and validation left out) against the whole fit's (issue 32)
    assert single["throughput"] == single["tokens_per_second"] > single["throughput_whole_fit"] > 0
    assert len(single["peak_memory_bytes"]) == 1 and "sample" in single
    assert single["activation_memory_bytes"][0] > 0 and single["activation_checkpointing"] == "none"
    assert (single["trainable_params"], single["frozen_params"]) == (gpt_params(), 0)  # no adapters: all train


def gpt_params() -> int:
    """Parameters of the recipe's default GPT, counted on a model built on the meta device."""
    import torch

    from lightning_parallel.models.gpt import RecipeGPT
    from lightning_parallel.recipes.gpt import gpt_config

    with torch.device("meta"):
        return sum(p.numel() for p in RecipeGPT(gpt_config(compose_gpt(*SHORT).model)).parameters())


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=zero3", "trainer.devices=2"],
        pytest.param(  # hybrid3d under a recipe in `make test`: test_recipe_vgg's dp=2 x tp=2
            ["strategy=hybrid3d", "strategy.pp=2", "strategy.tp=2", "trainer.devices=4"], marks=pytest.mark.slow
        ),
    ],
    ids=["zero3-2", "hybrid3d-pp2-tp2"],
)
def test_same_final_loss_in_other_layouts(overrides, single, tmp_path):
    got = run_recipe(tmp_path, *SHORT, *overrides)
    want = single["final_train_loss"]
    assert abs(got["final_train_loss"] - want) <= 1e-5 * want, (got["final_train_loss"], want)
    assert got["layout"]["world_size"] == int(overrides[-1].split("=")[1])  # as the workers saw it
    assert len(got["peak_memory_bytes"]) == got["layout"]["world_size"]


@pytest.mark.slow
def test_moe_recipe_at_ep2_matches_one_process_and_reports_expert_load(tmp_path):
    """model=gpt_moe_tiny: strategy.ep=2 at world 2 ends with the single-process loss; metrics.json has each MoE
    block's load (every routed token: steps x batch x seq x top-2) and balance loss, and the layout's ep."""
    moe = [*SHORT, "model=gpt_moe_tiny", "sample_tokens=0"]
    (tmp_path / "one").mkdir()
    (tmp_path / "ep2").mkdir()
    one = run_recipe(tmp_path / "one", *moe)
    got = run_recipe(tmp_path / "ep2", *moe, "strategy=hybrid3d", "strategy.ep=2", "trainer.devices=2")
    want = one["final_train_loss"]
    assert abs(got["final_train_loss"] - want) <= 1e-5 * want, (got["final_train_loss"], want)
    assert got["layout"]["ep"] == 2 and one["layout"]["ep"] == 1
    assert list(got["moe"]) == ["model.blocks.1.mlp", "model.blocks.3.mlp", "model.blocks.5.mlp"]
    for name, stats in got["moe"].items():
        assert stats["tokens_per_expert"] == one["moe"][name]["tokens_per_expert"]
        assert sum(stats["tokens_per_expert"]) == 6 * 32 * 64 * 2  # trainer=debug's batch of 32 sequences of 64
        assert stats["min_tokens"] <= stats["max_tokens"] and stats["aux_loss"] > 0.9


@pytest.mark.slow
def test_moe_recipe_at_ep2_x_pp2_logs_every_stage_s_expert_load(tmp_path):
    """model=gpt_moe_tiny at ep=2 x pp=2 (world 4) runs the recipe's callbacks past the first batch: each stage
    reports the MoE layers it holds, reduced over its ranks, and rank 0's log has every stage's layers with the
    single-process figures at every step (trainer=debug logs each one)."""
    moe = [*SHORT, "model=gpt_moe_tiny", "sample_tokens=0"]
    (tmp_path / "one").mkdir()
    (tmp_path / "ep2pp2").mkdir()
    one = run_recipe(tmp_path / "one", *moe)
    layout = ["strategy=hybrid3d", "strategy.ep=2", "strategy.pp=2", "trainer.devices=4"]
    got = run_recipe(tmp_path / "ep2pp2", *moe, *layout)
    want = one["final_train_loss"]
    assert abs(got["final_train_loss"] - want) <= 1e-5 * want, (got["final_train_loss"], want)
    assert list(got["moe"]) == ["model.blocks.1.mlp", "model.blocks.3.mlp", "model.blocks.5.mlp"]
    for name, stats in got["moe"].items():
        assert stats["tokens_per_expert"] == one["moe"][name]["tokens_per_expert"]
    logged, logged_one = moe_log(tmp_path / "ep2pp2"), moe_log(tmp_path / "one")
    assert sorted(logged) == sorted(logged_one) and len(logged) == 6 * 3 * 4  # steps x layers x figures
    for (step, column), value in logged_one.items():
        assert abs(logged[step, column] - value) <= 1e-5 * abs(value), (step, column, logged[step, column], value)


def moe_log(cwd) -> dict[tuple[str, str], float]:
    """(step, column) -> value of the moe/ columns in a recipe run's metrics.csv (rank 0's logger)."""
    (path,) = (cwd / "run").glob("logs/*/metrics.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {(r["step"], k): float(v) for r in rows for k, v in r.items() if k.startswith("moe/") and v}


@pytest.mark.slow
def test_same_final_loss_at_world_8(single, tmp_path):
    overrides = ["strategy=hybrid3d", "strategy.pp=2", "strategy.dp=2", "strategy.tp=2", "trainer.devices=8"]
    got = run_recipe(tmp_path, *SHORT, *overrides, timeout=600)
    assert abs(got["final_train_loss"] - single["final_train_loss"]) <= 1e-5 * single["final_train_loss"]
    want = {"dp": 2, "pp": 2, "tp": 2, "cp": 1, "ep": 1, "zero_stage": 0, "world_size": 8}
    assert {key: got["layout"][key] for key in want} == want, got["layout"]


SWEEPS = {  # devices and pipeline degrees swept: the jobs' (world size, peak-memory entries, pp, dp)
    "devices": ("1,2", "1", [(1, 1, 1, 1), (2, 2, 1, 2)]),
    "devices-and-pp": ("2,4", "1,2", [(2, 2, 1, 2), (2, 2, 2, 1), (4, 4, 1, 4), (4, 4, 2, 2)]),
}


@pytest.mark.parametrize(
    "sweep_name", [pytest.param("devices"), pytest.param("devices-and-pp", marks=pytest.mark.slow)]
)
def test_sweep_jobs_run_with_their_own_world_size(sweep_name, tmp_path):
    """-m over device counts (and pipeline degrees): each job starts its own workers, and the world size the
    workers report (from their process group, one peak-memory entry per rank) is the job's own."""
    devices, pp, want = SWEEPS[sweep_name]
    sweep = tmp_path / "sweep"
    sweep_args = ["-m", *SHORT, "trainer.max_steps=2", "strategy=hybrid3d", f"trainer.devices={devices}"]
    sweep_args.append(f"strategy.pp={pp}")
    run(tmp_path, GPT, *sweep_args, f"hydra.sweep.dir={sweep}", timeout=600)
    jobs = [json.loads((sweep / str(job) / "metrics.json").read_text()) for job in range(len(want))]
    seen = [
        (m["layout"]["world_size"], len(m["peak_memory_bytes"]), m["layout"]["pp"], m["layout"]["dp"]) for m in jobs
    ]
    assert seen == want
    with (sweep / "summary.csv").open(newline="") as f:
        summary = list(csv.DictReader(f))
    assert [(int(row["world_size"]), row["status"]) for row in summary] == [(w, "ok") for w, *_ in want]
    assert all(float(row["throughput"]) > 0 for row in summary)  # every job with its figures
    assert (sweep / "summary.png").stat().st_size > 10_000  # the throughput and memory plot


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            ["strategy=hybrid3d", "strategy.tp=3", "trainer.devices=6"],
            "tp=3 does not divide GPTConfig.n_head=8",
            marks=pytest.mark.slow,  # the same check runs in-process in test_bad_input_catalogue
        ),
        (
            ["strategy=hybrid3d", "strategy.dp=2", "strategy.pp=2", "strategy.tp=2", "trainer.devices=4"],
            "pp(2) * dp(2) * tp(2) = 8 != world_size(4)",
        ),
        pytest.param(["strategy=fsdp9"], "Could not find 'strategy/fsdp9'", marks=pytest.mark.slow),
        pytest.param(["strategy.name=fsdp9"], "strategy='fsdp9' is unknown: use ddp", marks=pytest.mark.slow),
    ],
    ids=["tp-heads", "degrees-world", "unknown-strategy", "unknown-strategy-name"],
)
def test_bad_override_fails_before_any_worker_starts(tmp_path, overrides, message):
    assert_fails_before_workers(GPT, tmp_path, *overrides, "trainer=debug", message=message)


def test_runs_under_torchrun(single, tmp_path):
    """`torchrun --nproc-per-node 2 recipes/train_gpt.py ...`: the recipe uses torchrun's processes."""
    run_dir = tmp_path / "run"
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", GPT, *SHORT]
    run(tmp_path, *torchrun, "strategy=zero2", "trainer.devices=2", f"hydra.run.dir={run_dir}")
    got = json.loads((run_dir / "metrics.json").read_text())
    assert got["layout"]["world_size"] == 2
    assert abs(got["final_train_loss"] - single["final_train_loss"]) <= 1e-5 * single["final_train_loss"]


@pytest.mark.slow  # 200 steps; test_single_process_run_writes_its_metrics runs the same path shortened
def test_the_readme_default_command_runs_as_written(tmp_path):
    """`make train` runs `python recipes/train_gpt.py`: 200 steps on the default corpus, about a minute."""
    result = run(tmp_path, GPT, timeout=600)
    got = default_run_metrics(tmp_path)
    assert got["steps"] == 200 and got["final_val_loss"] < 3.0  # from 5.5, a uniform guess over 256 bytes
    assert "--- sample ---" in result.stdout


def test_ckpt_path_last_starts_fresh_then_resumes(tmp_path):
    """The same command twice (as a preempted job would be rerun): the first starts from scratch, the
    second continues from the newest checkpoint in checkpoint.dir."""
    common = [*SHORT, "checkpoint=periodic", "checkpoint.every_n_steps=3", "ckpt_path=last"]
    first = run_recipe(tmp_path, *common, "trainer.max_steps=6")
    assert first["steps"] == 6 and (tmp_path / "checkpoints" / "last.ckpt").is_file()
    second = run_recipe(tmp_path, *common, "trainer.max_steps=9")
    assert second["steps"] == 9
    with open(tmp_path / "run" / "logs" / "version_1" / "metrics.csv") as f:
        steps = {int(row["step"]) for row in csv.DictReader(f) if row.get("train_loss")}
    assert min(steps) >= 6 and max(steps) == 8  # the second run trained steps 7 to 9 only


@pytest.mark.slow  # the same check runs in-process in test_bad_input_catalogue (ckpt-last-without-dir)
def test_ckpt_path_last_needs_a_checkpoint_dir(tmp_path):
    assert_fails_before_workers(GPT, tmp_path, "ckpt_path=last", "trainer=debug", message="looks in checkpoint.dir")
