"""How a recipe job finds its processes: spawned by itself, given by torchrun, or given by SLURM."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_parallel.recipes import launch
from lightning_parallel.recipes.config import register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
CALLS: list[int] = []

register_configs()


def record(cfg, run_dir) -> str:
    """A stand-in for a recipe's train(): proves run() called it in this process."""
    CALLS.append(cfg.trainer.devices)
    return "ran here"


def config(**trainer) -> OmegaConf:
    return OmegaConf.create({"trainer": {"devices": 1, "num_nodes": 1, **trainer}})


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    CALLS.clear()
    return monkeypatch


def test_slurm_tasks_run_the_job_in_place(clean_env, tmp_path):
    """In a SLURM batch job's tasks the processes exist: no worker of our own is started."""
    clean_env.setenv("SLURM_NTASKS", "8")
    clean_env.setenv("SLURM_JOB_NAME", "train_gpt")
    assert launch.launched_externally()
    assert launch.run(config(devices=4, num_nodes=2), tmp_path, entry=f"{__name__}.record") == "ran here"
    assert CALLS == [4]


def test_an_interactive_slurm_shell_is_not_a_launcher(clean_env):
    clean_env.setenv("SLURM_NTASKS", "8")
    clean_env.setenv("SLURM_JOB_NAME", "bash")  # salloc's shell: python runs once, so it must spawn workers
    assert not launch.launched_externally()


def test_torchrun_world_must_match_devices(clean_env, tmp_path):
    for name, value in {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=r"trainer.devices=4 but torchrun started 2 processes per node"):
        launch.run(config(devices=4), tmp_path, entry=f"{__name__}.record")
    assert CALLS == []


def test_several_nodes_need_an_outside_launcher(clean_env, tmp_path):
    with pytest.raises(ValueError, match=r"trainer.num_nodes=2 needs processes started on every node"):
        launch.run(config(devices=2, num_nodes=2), tmp_path, entry=f"{__name__}.record")
    assert CALLS == []


def test_the_slurm_launcher_config_asks_for_the_job_s_processes():
    overrides = ["hydra/launcher=slurm", "trainer.devices=4", "trainer.num_nodes=2", "hydra.launcher.partition=gpu"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train_gpt", overrides=overrides, return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)
    assert launcher.partition == "gpu"


def restartable(tmp_path, restarts: int) -> OmegaConf:
    cfg = config(devices=2)
    cfg.merge_with({"max_restarts": restarts, "ckpt_path": None, "checkpoint": {"dir": str(tmp_path / "ckpt")}})
    return cfg


def test_max_restarts_starts_the_workers_again_from_the_last_checkpoint(clean_env, tmp_path):
    """A worker SIGKILLed once: the launch ends, the recipe's launcher starts both workers again with
    ckpt_path=last, and the run finishes (rank 0's result). The GPT recipe's own run of it, resumed bitwise, is
    tests/test_recipe_restarts.py (slow tier)."""
    got = launch.run(restartable(tmp_path, 1), tmp_path, entry="launch_entries.die_once")
    assert got == "finished"
    attempts = [tuple(line.split()) for line in (tmp_path / "attempts.txt").read_text().splitlines()]
    # the first launch: rank 1 died (rank 0 may have been stopped before it began); the second: both, from last
    first, second = [a for a in attempts if a[1] == "None"], sorted(a for a in attempts if a[1] == "last")
    assert ("1", "None") in first and len(first) == len(set(first)) and second == [("0", "last"), ("1", "last")]


def test_a_restart_keeps_a_given_checkpoint_until_one_is_saved(tmp_path):
    cfg = restartable(tmp_path, 1)
    cfg.ckpt_path = str(tmp_path / "pretrained.ckpt")
    assert launch.restart_path(cfg) == cfg.ckpt_path  # nothing saved in checkpoint.dir yet: start as given
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "last.ckpt").mkdir()
    assert launch.restart_path(cfg) == "last"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["max_restarts=2"], r"max_restarts=2 restarts from the newest checkpoint in checkpoint.dir, which is not set"),
        (["max_restarts=-1", "checkpoint=periodic"], r"max_restarts=-1: give 0"),
    ],
)
def test_max_restarts_needs_checkpoints(overrides, message):
    from lightning_parallel.recipes.checks import check_checkpoint_settings

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train_gpt", overrides=overrides)
    with pytest.raises(ValueError, match=message):
        check_checkpoint_settings(cfg)
