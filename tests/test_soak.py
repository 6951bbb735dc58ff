"""Soak: the GPT recipe at world 8 (pp=2 x dp=2 x tp=2) for hundreds of steps with periodic checkpoints, two
workers SIGKILLed at two random steps, restarted by `torchrun --max-restarts 2`: the job resumes from its
newest checkpoint each time and ends with exactly (bitwise, fp32) the parameters and optimizer states of an
undisturbed run. `make soak` runs it and prints the result; SOAK_STEPS and SOAK_EVERY change its length."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from recipe_runs import GPT
from recipe_runs import env as recipe_env
from test_fault_tolerance import workers_of
from test_recipe_gpt import SHORT
from test_recipe_resume import assert_same_states

from lightning_parallel.checkpoint import consolidated

STEPS = int(os.environ.get("SOAK_STEPS", "300"))
EVERY = int(os.environ.get("SOAK_EVERY", "25"))
WORLD, KILLS = 8, 2
LAYOUT = ["strategy=hybrid3d", "strategy.pp=2", "strategy.tp=2", f"trainer.devices={WORLD}"]  # dp=2
ARGS = [*SHORT, f"trainer.max_steps={STEPS}", "trainer.val_check_interval=100", *LAYOUT, "checkpoint=periodic"]
# keep_last=-1: every step folder stays (the kills wait for them). With keep_last=2 at this layout the folders
# after the first two were never written: ModelCheckpoint's top-k vote (reduce_boolean_decision) sums over the
# dp axis only, 2 votes != world 8
ARGS += [f"checkpoint.every_n_steps={EVERY}", "checkpoint.keep_last=-1", "ckpt_path=last"]
TIMEOUT = 60 * 60


def torchrun(cwd: Path) -> subprocess.Popen:
    env = recipe_env()
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # restarted gloo workers need a fresh store (see test_fault_...)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)]
    cmd += ["--max-restarts", str(KILLS), "--monitor-interval", "0.5", str(GPT), *ARGS, f"hydra.run.dir={cwd / 'run'}"]
    log = open(cwd / "torchrun.log", "w")
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for_checkpoint(job: subprocess.Popen, cwd: Path, step: int, deadline: float) -> None:
    while not list((cwd / "checkpoints").glob(f"*step={step}.ckpt")):
        assert job.poll() is None and time.monotonic() < deadline, (cwd / "torchrun.log").read_text()[-4000:]
        time.sleep(0.1)


def kill_steps(rng: random.Random) -> list[int]:
    """Checkpoint steps after which a worker dies (a random moment within the next EVERY steps, maybe during
    a save): the second at least two saves after the first, so the restarted attempt must write it."""
    saves = list(range(EVERY, STEPS - EVERY, EVERY))
    first = rng.choice(saves[: len(saves) // 2])
    return [first, rng.choice([s for s in saves if s >= first + 2 * EVERY])]


@pytest.mark.slow
def test_soak_two_killed_workers_end_like_an_undisturbed_run(tmp_path):
    assert STEPS % EVERY == 0 and STEPS >= 6 * EVERY, "SOAK_STEPS must be a multiple of SOAK_EVERY, >= 6 of them"
    calm, hit = tmp_path / "calm", tmp_path / "hit"
    calm.mkdir()
    hit.mkdir()
    start = time.monotonic()
    assert torchrun(calm).wait(timeout=TIMEOUT) == 0, (calm / "torchrun.log").read_text()[-4000:]
    calm_seconds = time.monotonic() - start

    rng = random.Random()
    start, victims = time.monotonic(), []
    job = torchrun(hit)
    for step in kill_steps(rng):
        wait_for_checkpoint(job, hit, step, start + TIMEOUT)
        time.sleep(rng.uniform(0.0, 1.0) * EVERY * calm_seconds / STEPS)  # a random later step
        victim = rng.choice(workers_of(job))
        os.kill(victim, signal.SIGKILL)
        victims.append((step, victim))
    assert job.wait(timeout=TIMEOUT) == 0, (hit / "torchrun.log").read_text()[-4000:]
    hit_seconds = time.monotonic() - start
    log = (hit / "torchrun.log").read_text()
    assert log.count("(exitcode: -9)") == KILLS, f"expected {KILLS} killed workers:\n{log[-4000:]}"
    attempts = len(list((hit / "run" / "logs").glob("version_*")))  # each attempt logs into a new version
    assert attempts == KILLS + 1, f"{attempts} attempts, expected {KILLS + 1}"

    want = consolidated(calm / "checkpoints" / "last.ckpt")
    got = consolidated(hit / "checkpoints" / "last.ckpt")
    assert want["global_step"] == got["global_step"] == STEPS
    what = f"after SIGKILLs (after the step-{victims[0][0]} and step-{victims[1][0]} saves)"
    assert_same_states(got["state_dict"], want["state_dict"], f"parameters {what}")
    assert_same_states(got["optimizer_states"][0], want["optimizer_states"][0], f"optimizer state {what}")
    print(
        f"\nsoak: world {WORLD} (pp=2 x dp=2 x tp=2), {STEPS} steps, a checkpoint every {EVERY}; undisturbed "
        f"{calm_seconds:.0f} s; {KILLS} workers killed {victims} (checkpoint step, pid), restarted by torchrun, "
        f"{hit_seconds:.0f} s; final parameters and optimizer states bitwise equal: OK"
    )
