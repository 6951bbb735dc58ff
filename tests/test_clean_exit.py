"""How a run ends, seen from outside as a user's job sees it: a run that finished its work exits 0 under
torchrun (every time: the slow tier runs 20 launches per strategy family) and under Lightning's own launcher,
``fit`` then ``test`` included; an error in user code ends every rank with a non-zero status, without a hang,
printed once; a SIGTERM to an outside torchrun saves ``last``, every worker exits 0 within torchrun's grace
period, and the resumed run ends bitwise where an undisturbed one does. The workers end as user scripts do:
nothing skips the interpreter's shutdown (``lightning_parallel/parallel/shutdown.py`` is what makes that safe).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import WORKERS, free_port
from recipe_runs import GPT
from recipe_runs import env as recipe_env
from test_recipe_gpt import SHORT
from test_recipe_resume import assert_same_states

from lightning_parallel.checkpoint import consolidated

EXIT_WORKER = WORKERS / "exit_worker.py"
FAMILIES = {"zero2": 2, "zero3": 2, "hybrid3d-pp2-tp2": 4}  # strategy -> processes
STRESS_RUNS = 20


def torchrun(nproc: int, *script: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [str(s) for s in script]
    return subprocess.run(cmd, cwd=cwd, env=recipe_env(), capture_output=True, text=True, timeout=timeout)


def done(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("DONE ")]
    assert len(lines) == 1, output[-4000:]
    return json.loads(lines[0][5:])


def finished_fit(strategy: str, cwd: Path, *extra: str) -> tuple[int, str]:
    """One short fit under torchrun: its exit status and output (the fit must have finished its work)."""
    nproc = FAMILIES[strategy]
    result = torchrun(nproc, EXIT_WORKER, "--strategy", strategy, "--devices", nproc, *extra, cwd=cwd)
    output = result.stdout + result.stderr
    assert done(output)["step"] == 4, output[-4000:]
    return result.returncode, output


RELEASE = """
import os, torch, torch.distributed as dist
from lightning_parallel.parallel.shutdown import release_process_groups
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
cycle = {"group": dist.new_group([0])}
cycle["self"] = cycle  # as the mesh's groups are held: only the garbage collector frees them
dist.all_reduce(torch.ones(4), group=cycle["group"])
del cycle
during = threads()
release_process_groups()
print(before, during, threads(), dist.is_initialized())
"""


def test_release_process_groups_ends_gloo_s_threads(tmp_path):
    """What the atexit handler does, seen directly: gloo's worker threads end while the interpreter runs (the
    groups are destroyed and collected), also those only a reference cycle holds."""
    code = RELEASE % free_port()
    result = subprocess.run([sys.executable, "-c", code], env=recipe_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    before, during, after, initialized = result.stdout.split()
    assert int(during) > int(before), result.stdout  # gloo started its threads
    assert (int(after), initialized) == (int(before), "False"), result.stdout


@pytest.mark.parametrize(
    "strategy", [pytest.param(s, marks=pytest.mark.slow) if n > 2 else s for s, n in FAMILIES.items()]
)  # world 4 in `make test-full` (test budget)
def test_a_finished_fit_exits_0_under_torchrun(strategy, tmp_path):
    code, output = finished_fit(strategy, tmp_path)
    assert code == 0, output[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", FAMILIES)
def test_twenty_finished_fits_under_torchrun_all_exit_0(strategy, tmp_path):
    failed = {}
    for i in range(STRESS_RUNS):
        code, output = finished_fit(strategy, tmp_path)
        if code != 0:
            failed[i] = (code, output[-2000:])
    print(f"{strategy}: {len(failed)} non-zero exits in {STRESS_RUNS} torchrun launches")
    assert not failed, f"{len(failed)}/{STRESS_RUNS} finished runs exited non-zero: {failed}"


def test_fit_then_test_in_one_script_exits_0_under_torchrun(tmp_path):
    code, output = finished_fit("zero3", tmp_path, "--test")
    assert code == 0, output[-4000:]


def test_fit_then_test_exits_0_under_lightning_s_launcher(tmp_path):
    cmd = [sys.executable, str(EXIT_WORKER), "--strategy", "hybrid3d-pp2", "--devices", "2", "--test"]
    result = subprocess.run(cmd, cwd=tmp_path, env=recipe_env(), capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert done(output)["step"] == 4


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("lightning", marks=pytest.mark.slow)])
def test_an_error_in_user_code_ends_every_rank_non_zero_printed_once(launcher, tmp_path):
    args = [EXIT_WORKER, "--strategy", "zero2", "--raise-at", "2"]
    if launcher == "torchrun":
        result = torchrun(2, *args, cwd=tmp_path, timeout=120)
    else:
        cmd = [sys.executable, *map(str, args), "--devices", "2"]
        result = subprocess.run(cmd, cwd=tmp_path, env=recipe_env(), capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "DONE" not in output
    # rank 0 raised: its error once (not again by a second handler, not lost to the launcher's SIGTERM); rank 1's
    # collective failed: its own error, once, naming rank 0's
    error = "ValueError: a bug in the user's training step at step 2"
    lines = output.splitlines()
    assert sum(line.endswith(error) and "failed first" not in line for line in lines) == 1, output[-6000:]
    assert sum(f"rank 0 failed first: {error}" in line for line in lines) <= 1, output[-6000:]


STEPS, EVERY = 16, 4
ARGS = [*SHORT, f"trainer.max_steps={STEPS}", "strategy=zero2", "trainer.devices=2", "checkpoint=periodic"]
ARGS += [f"checkpoint.every_n_steps={EVERY}", "checkpoint.keep_last=-1"]


@pytest.mark.slow  # test budget (53 s): test_preemption.py stops every rank on SIGTERM in `make test`
def test_sigterm_to_an_outside_torchrun_saves_exits_0_and_resumes_bitwise(tmp_path):
    """Kubernetes and SLURM signal torchrun; torch elastic forwards SIGTERM to the workers and gives them 30 s."""
    calm, hit = tmp_path / "calm", tmp_path / "hit"
    for d in (calm, hit):
        d.mkdir()
    result = torchrun(2, GPT, *ARGS, f"hydra.run.dir={calm / 'run'}", cwd=calm)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    statuses = hit / "statuses"
    statuses.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(WORKERS / "exit_status.py"), str(statuses), str(GPT), *ARGS, f"hydra.run.dir={hit / 'run'}"]
    log = hit / "torchrun.log"
    with open(log, "w") as sink:
        agent = subprocess.Popen(cmd, cwd=hit, env=recipe_env(), stdout=sink, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not list((hit / "checkpoints").glob(f"*step={EVERY}.ckpt")):  # mid-training
            assert agent.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=120)
    output = log.read_text()
    codes = {p.name: int(p.read_text()) for p in statuses.iterdir()}
    assert codes == {"rank0.status": 0, "rank1.status": 0}, output[-4000:]
    assert "forcefully exiting" not in output, output[-4000:]  # no worker outlived torchrun's grace period
    saved = consolidated(hit / "checkpoints" / "last.ckpt")["global_step"]
    assert EVERY <= saved < STEPS and f"stopped after step {saved} on every rank" in output, output[-4000:]

    result = torchrun(2, GPT, *ARGS, "ckpt_path=last", f"hydra.run.dir={hit / 'run'}", cwd=hit)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    want = consolidated(calm / "checkpoints" / "last.ckpt")
    got = consolidated(hit / "checkpoints" / "last.ckpt")
    assert got["global_step"] == want["global_step"] == STEPS
    assert_same_states(got["state_dict"], want["state_dict"], f"parameters (SIGTERM after step {saved})")
    assert_same_states(got["optimizer_states"][0], want["optimizer_states"][0], "optimizer state")


def test_a_launch_that_does_not_match_devices_is_refused_by_name(monkeypatch):
    """torchrun started 4 processes, the Trainer was told devices=2: said before any device or group is used."""
    import torch
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from lightning_parallel import ZeroStrategy

    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3", "GROUP_RANK": "0"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    strategy = ZeroStrategy(stage=2, cluster_environment=TorchElasticEnvironment())
    strategy.parallel_devices = [torch.device("cpu")] * 2
    with pytest.raises(
        ValueError, match=r"Trainer\(devices=2, num_nodes=1\) expects 2 processes, but the launcher started 4"
    ):
        strategy.setup_environment()
