"""A worker killed mid-training under `torchrun --max-restarts`: the job restarts, resumes from its newest
checkpoint by itself (ckpt_path=last) and ends with exactly the parameters of an undisturbed run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from recipe_runs import GPT
from recipe_runs import env as recipe_env
from test_recipe_gpt import SHORT
from test_recipe_resume import assert_same_states

from lightning_parallel.checkpoint import consolidated

STEPS, EVERY = 24, 3
ARGS = [*SHORT, f"trainer.max_steps={STEPS}", "strategy=zero2", "trainer.devices=2", "checkpoint=periodic"]
ARGS += [f"checkpoint.every_n_steps={EVERY}", "checkpoint.keep_last=2", "ckpt_path=last"]


def torchrun(cwd: Path) -> subprocess.Popen:
    env = recipe_env()
    # restarted workers must not share the rendezvous store of the first attempt: they read the dead
    # workers' addresses from it (pytorch/pytorch#135712); the README says so for users too
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1"]
    cmd += ["--monitor-interval", "0.5", str(GPT), *ARGS, f"hydra.run.dir={cwd / 'run'}"]
    log = open(cwd / "torchrun.log", "w")
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


def workers_of(agent: subprocess.Popen) -> list[int]:
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    return [int(pid) for pid in children]


@pytest.mark.slow
def test_killed_worker_restarts_and_ends_like_an_undisturbed_run(tmp_path):
    calm, hit = tmp_path / "calm", tmp_path / "hit"
    calm.mkdir()
    hit.mkdir()
    assert torchrun(calm).wait(timeout=600) == 0, (calm / "torchrun.log").read_text()[-4000:]

    job = torchrun(hit)
    deadline = time.monotonic() + 600
    while not list((hit / "checkpoints").glob(f"*step={2 * EVERY}.ckpt")):  # two checkpoints in
        assert job.poll() is None and time.monotonic() < deadline, (hit / "torchrun.log").read_text()[-4000:]
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 1.0))  # a random later step, maybe in the middle of a save
    victim = random.choice(workers_of(job))
    os.kill(victim, signal.SIGKILL)
    assert job.wait(timeout=600) == 0, (hit / "torchrun.log").read_text()[-4000:]
    log = (hit / "torchrun.log").read_text()
    assert "Restarting" in log or "restart" in log.lower(), "the agent never restarted the workers"

    for run in (calm, hit):  # checkpoint.keep_last=2: the two newest step folders, plus last.ckpt
        assert sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")) == [
            f"epoch=0-step={STEPS - EVERY}.ckpt",
            f"epoch=0-step={STEPS}.ckpt",
            "last.ckpt",
        ]
    want = consolidated(calm / "checkpoints" / "last.ckpt")
    got = consolidated(hit / "checkpoints" / "last.ckpt")
    assert want["global_step"] == got["global_step"] == STEPS
    assert_same_states(got["state_dict"], want["state_dict"], f"parameters after a SIGKILL of pid {victim}")
    assert all(torch.isfinite(t).all() for t in got["state_dict"].values())
