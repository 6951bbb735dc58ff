"""The recipe's own launcher restarts a run that lost a process (``max_restarts``): a worker SIGKILLed once the
first checkpoint is written, the launcher starts both workers again from the newest checkpoint, and the run ends
with bitwise the parameters and optimizer states of a run never disturbed (the GPT recipe, ZeRO-2 at world 2).
The launcher's side alone, with a stand-in for the training, is in tests/test_recipe_launch.py (fast tier)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from recipe_runs import GPT
from recipe_runs import env as recipe_env
from test_recipe_gpt import SHORT
from test_recipe_resume import assert_same_states

from lightning_parallel.checkpoint import consolidated

STEPS, EVERY = 40, 10
ARGS = [*SHORT, f"trainer.max_steps={STEPS}", "trainer.val_check_interval=20", "trainer.devices=2", "strategy=zero2"]
ARGS += ["checkpoint=periodic", f"checkpoint.every_n_steps={EVERY}", "checkpoint.keep_last=-1"]


def start(cwd: Path, *extra: str) -> subprocess.Popen:
    cwd.mkdir()
    log = open(cwd / "run.log", "w")
    cmd = [sys.executable, str(GPT), *ARGS, *extra, f"hydra.run.dir={cwd / 'run'}"]
    return subprocess.Popen(cmd, cwd=cwd, env=recipe_env(), stdout=log, stderr=subprocess.STDOUT)


def spawned_workers(pid: int) -> list[int]:
    """The recipe's training processes: its children started by multiprocessing's spawn."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]


def logged_losses_of(version: Path) -> dict[int, float]:
    """The steps and losses one attempt logged."""
    with open(version / "metrics.csv") as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_undisturbed(tmp_path):
    calm, hit = tmp_path / "calm", tmp_path / "hit"
    assert start(calm).wait(timeout=900) == 0, (calm / "run.log").read_text()[-4000:]
    job = start(hit, "max_restarts=1")
    deadline = time.monotonic() + 900
    saved = hit / "checkpoints"
    while not (list(saved.glob(f"*step={EVERY}.ckpt")) and (saved / "last.ckpt").exists()):
        assert job.poll() is None and time.monotonic() < deadline, (hit / "run.log").read_text()[-4000:]
        time.sleep(0.1)
    victim = spawned_workers(job.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    assert job.wait(timeout=900) == 0, (hit / "run.log").read_text()[-4000:]
    log = (hit / "run.log").read_text()
    assert f"killed by SIGKILL (pid {victim})" in log and "Restart 1 of max_restarts=1" in log, log[-4000:]
    second = sorted((hit / "run" / "logs").glob("version_*"))[-1]  # the restarted workers' log
    assert min(logged_losses_of(second)) >= EVERY, "the restart continued from a checkpoint, not from step 0"
    want, got = consolidated(calm / "checkpoints" / "last.ckpt"), consolidated(hit / "checkpoints" / "last.ckpt")
    assert want["global_step"] == got["global_step"] == STEPS
    assert_same_states(got["state_dict"], want["state_dict"], f"parameters after the SIGKILL of pid {victim}")
    assert_same_states(got["optimizer_states"][0], want["optimizer_states"][0], "optimizer states")
