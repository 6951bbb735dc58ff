"""SIGTERM (a scheduler's notice before preemption): every rank stops after the same step, ``last`` is saved,
the run exits with status 0, and ``ckpt_path=last`` continues to exactly the parameters of a run that was
never stopped. Through the recipe (SIGTERM to the launching process, which torch elastic forwards to the
workers) and in a plain Trainer script where the signal reaches one rank only."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from harness import WORKERS, run_worker
from recipe_runs import GPT, run_recipe
from recipe_runs import env as recipe_env
from test_recipe_gpt import SHORT
from test_recipe_resume import assert_same_states

from lightning_parallel.checkpoint import consolidated

STEPS, EVERY = 16, 4
ARGS = [*SHORT, f"trainer.max_steps={STEPS}", "strategy=zero2", "trainer.devices=2", "checkpoint=periodic"]
ARGS += [f"checkpoint.every_n_steps={EVERY}", "checkpoint.keep_last=-1"]


@pytest.mark.slow  # test_sigterm_to_one_rank_stops_every_rank_after_the_same_step keeps the save in `make test`
def test_sigterm_saves_last_and_the_resumed_run_ends_like_an_undisturbed_one(tmp_path):
    calm, hit = tmp_path / "calm", tmp_path / "hit"
    calm.mkdir()
    hit.mkdir()
    run_recipe(GPT, calm, *ARGS)

    cmd = [sys.executable, str(GPT), *ARGS, f"hydra.run.dir={hit / 'run'}"]
    job = subprocess.Popen(cmd, cwd=hit, env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not list((hit / "checkpoints").glob(f"*step={EVERY}.ckpt")):  # mid-training
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-4000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)  # to the launching process, as a scheduler does
    output = job.communicate(timeout=300)[0]
    assert job.returncode == 0, output[-4000:]
    preempted = json.loads((hit / "run" / "preempted.json").read_text())
    assert EVERY <= preempted["step"] < STEPS, preempted
    assert f"Preempted: every worker stopped after step {preempted['step']}" in output, output[-4000:]
    assert consolidated(hit / "checkpoints" / "last.ckpt")["global_step"] == preempted["step"]

    resumed = run_recipe(GPT, hit, *ARGS, "ckpt_path=last")
    assert resumed["steps"] == STEPS
    want = consolidated(calm / "checkpoints" / "last.ckpt")
    got = consolidated(hit / "checkpoints" / "last.ckpt")
    assert got["global_step"] == want["global_step"] == STEPS
    stopped = f"stopped by SIGTERM after step {preempted['step']}"
    assert_same_states(got["state_dict"], want["state_dict"], f"parameters ({stopped})")
    assert_same_states(got["optimizer_states"][0], want["optimizer_states"][0], f"optimizer state ({stopped})")


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Lightning's launcher, hybrid3d on 2 processes; rank 1 alone gets SIGTERM, during step 3 (0-based). The flag's
    reduction runs without a host sync: step 3's end starts it, step 4's end reads it, so both stop after step 4
    (0-based), global step 5."""
    case = {"fail": "sigterm", "rank": 1, "step": 3, "devices": 2}
    cmd = [sys.executable, WORKERS / "run.py", "rank_failure", "--opts", json.dumps(case), "--out", tmp_path]
    result = subprocess.run(list(map(str, cmd)), cwd=tmp_path, env=recipe_env(), capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    stops = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert stops[0] == stops[1] == {"step": 5, "exception": "SIGTERMException"}, stops
    assert consolidated(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 5
    assert "Preempted (SIGTERM): stopped after step 5 on every rank" in output, output[-4000:]


@pytest.mark.slow  # the gloo world path is in the fast tier (test_sigterm_to_one_rank_stops_every_rank_...)
def test_the_flag_is_read_a_step_later_over_a_gloo_group_of_its_own_on_an_nccl_world(tmp_path):
    """No host sync per step: the flag reduced without waiting, read at the next step's end, by every rank alike;
    on a world whose groups take no host tensors (NCCL, reported here) over a gloo group of all ranks."""
    case = {"steps": 4, "step": 2, "rank": 1}
    ranks = run_worker("preemption_flag", 2, ["--opts", json.dumps(case)], tmp_path, timeout=300)
    want = [False, False, False, True]  # signal before step 2's end: every rank stops at step 3's
    assert [r["stops"] for r in ranks] == [want, want], ranks
    assert all(r["own_group"] and r["group_size"] == 2 for r in ranks), ranks
